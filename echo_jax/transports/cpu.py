"""The CPU "p2p" transport: the Echo all-reduce as an XLA FFI custom call (module `echo_jax._ffi`).

`allreduce` has the signature of `echo_jax.transports.xla.allreduce` and returns the same bits;
`allreduce_compensated` fuses Algorithm 1 of the Echo paper into the call and returns the same
bits as `compensator.apply_correction` + `xla_allreduce` + `compensator.update_state`. Both run
inside `jax.shard_map`: every rank of the reduced axis is one device, and the ranks of a group
meet inside the custom call (on CPU: host threads over shared memory, see
ffi/echo_allreduce_cpu.cc). The protocol and the wire format are those of `collective.py` and
`quant.py`.

Rotation: with `config.rotation="hadamard"` both calls rotate inside the handler (attribute
rotate = 1): every group of the padded layout that holds an element of x is rotated by the
randomized Hadamard matrix after the apply step, the protocol runs in the rotated basis, and each
group of the sum is rotated back before it is stored and the state is updated (in the original
basis). The bits are those of `echo_jax.transports.xla.rotated_allreduce` (pad to whole groups,
`rotation.hadamard_rotate`, the all-reduce, `rotation.hadamard_unrotate`, cut) around the same
compensator steps; `fused_rotation` says so to `echo_psum`. A rescaling factor multiplies x
before the rotation (and divides the sum after the inverse rotation), as in that reference.

On CPU (ffi/echo_allreduce_cpu.cc) the handler is asynchronous: each rank's call returns a
future to XLA and runs push / reduce / gather / tail on a host thread of its own, the ranks meeting
in a workspace per (call site, devices of the group) that is allocated at the first execution and
reused by every later one; readiness is one monotone flag per rank whose base rises by 3 per call.
A rank that waits longer than ECHO_JAX_TIMEOUT_S for a peer fails the execution with an error
that names the stage, the group, the rank and the missing peer.

`echo_jax.transports.select` says which transport a call runs. This one needs

* a handler for the platform in `echo_jax._ffi` ("cpu"; the GPU custom call is the separate
  module `echo_jax._ffi_cuda`, the transport `echo_jax.transports.cuda`),
* one process (the CPU handler shares host memory between the ranks),
* a `jax.shard_map` in which the reduced axis and every other mesh axis of size > 1 are manual.
  Under `jax.vmap(..., axis_name=...)` the ranks are batch entries of one device and a custom
  call that waits for its peers would deadlock, so vmap always runs the "xla" transport.

Attributes and limits (validated here with messages that say what to fix, and again in C++;
`base.limit_reason` is the one list of the size limits):

=================  =========================================================================
num_ranks          P, the size of the reduced axis: 1 .. 256
bits               4 or 8
group_size         g: 1 .. 65536, even at 4 bits
policy             int code: 0 = "asym", 1 = "sym", 2 = "asym_naive" (`echo_jax.policies`)
segment_groups     groups per segment, ceil(ceil(max(n, 1) / g) / P) (`segment_layout`);
                   segment_groups * g <= 2^31 - 1
site               id of the traced call site (keeps independent all-reduces of one program
                   apart; a new id per trace)
timeout_ms         how long a rank waits for a peer before failing: ECHO_JAX_TIMEOUT_S
                   (seconds, default 10), read when the call is traced
debug_absent_rank  test hook (`debug_absent_rank()`), -1 normally
debug_failing_     test hook (`debug_failing_rank()`): rank (-1 normally), stage (0 = validation,
rank, _stage,      1 = push, 2 = after the tail) and cause ("" normally) of a rank that fails
debug_failure      on purpose
rotate             1: rotate every group (`config.rotation == "hadamard"`; g a power of two),
                   0: no rotation
ea, eb, b1, c1,    fp32 coefficients of `compensator.Coefficients` and f32(1/P)
b2, c2, inv_p  (compensated and applied calls only)
residual_local     1: the averages take each rank's local rounding errors
                   (`config.residual == "local"`; rotate must be 0), 0: u = x' - y/P
                   (compensated and applied calls; the applied call takes 0 only)
=================  =========================================================================

Operands: x [n] in float32, bfloat16 or float16, (for the compensated call m1, m2 in fp32 or bf16,
n elements in the state's own shape, aliased to their outputs), and coords int32 [2] =
(axis_index(axis), group id), the group id numbering the other manual axes. The sum y has x's
dtype: a 16-bit x enters and leaves the call in its own dtype (no fp32 copy of it in XLA around the
call); the handler loads it to fp32 exactly, runs the protocol in fp32 and rounds the sum to x's
dtype to nearest even, like `xla_allreduce(x.astype(f32)).astype(x.dtype)`. The compensated call
updates its state (`FUSED_STATE_DTYPES`: fp32, bf16, or int8 / int4 codes with their fp32 scales
through TARGET_COMPENSATED_Q8) with the fp32 sum, before that rounding.
The applied call (`allreduce_applied`, `EchoConfig.state_update="separate"`) takes m1, m2 as
read-only operands, runs the apply step only and returns y; the update is left to its own op.
With `EchoConfig.residual="local"` the compensated call updates the state where it quantizes,
from each rank's own rounding errors (`allreduce_compensated`), with the bits of
`echo_jax.transports.xla.xla_allreduce_local`.
"""

from __future__ import annotations

import sys

import contextlib
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from echo_jax import _compat
from echo_jax import compensator as comp
from echo_jax import policies
from echo_jax.config import EchoConfig
from echo_jax.transports import base
from echo_jax.transports.base import TIMEOUT_ENV, build_mismatch, factor_operand

try:
    from echo_jax import _ffi
except ImportError as _err:  # pragma: no cover - only without the compiled extension
    _ffi = None
    #: Why `echo_jax._ffi` did not import (None when it did).
    _import_error = str(_err)
else:
    _import_error = None

#: The value of `EchoConfig.transport` that selects the custom calls.
NAME = "p2p"

TARGET = "echo_allreduce_cpu"
TARGET_COMPENSATED = "echo_allreduce_comp_cpu"
TARGET_APPLIED = "echo_allreduce_applied_cpu"
TARGET_COMPENSATED_Q8 = "echo_allreduce_comp_q8_cpu"

MAX_RANKS = 256
#: dtypes of the contribution x (and of the sum y): the call reads and writes them itself.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
POLICY_CODES = policies.CODES  # asym 0, sym 1, asym_naive 2

#: The state dtypes (`EchoConfig.state_dtype`) the fused compensated call takes (int8, int4:
#: with group_size 128, `base.Transport`, both through TARGET_COMPENSATED_Q8, which tells them
#: apart by the codes' element type; the applied call takes the first two).
FUSED_STATE_DTYPES = ("float32", "bfloat16", "int8", "int4")

_lock = threading.Lock()
_registered: set[str] = set()
_sites = itertools.count(1)
_debug_absent_rank = -1
_debug_failing = (-1, 0, "")  # (rank, stage code, cause): see debug_failing_rank
#: Stages where `debug_failing_rank` makes its rank fail (codes of the attribute).
DEBUG_FAILING_STAGES = {"validate": 0, "push": 1, "tail": 2}


def available_platforms() -> tuple[str, ...]:
    """Platforms this build has custom-call handlers for (empty without the extension)."""
    return tuple(_ffi.platforms()) if _ffi is not None else ()


def _register(platform: str) -> None:
    """Registers the FFI targets for `platform` once, after the backend is initialised."""
    if platform in _registered:
        return
    with _lock:
        if platform in _registered:
            return
        jax.devices()  # initialise the backends first: registration needs them
        if platform == "cpu":
            for name, capsule in _ffi.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _registered.add(platform)


def fused_rotation(config: EchoConfig) -> bool:
    """Whether the CPU call rotates by itself for this config: yes, for every group size the
    rotation allows (a power of two, which `EchoConfig` enforces with rotation="hadamard").

    Args:
      config: the call's EchoConfig.
    """
    g = config.group_size
    return g > 0 and g & (g - 1) == 0


def module_reason() -> tuple[str, str] | None:
    """Why the module echo_jax._ffi cannot serve a call, as (kind, sentence with the fix): it is
    missing ("not_built") or the running jaxlib refuses it ("build_mismatch"); None when it is
    built and accepted."""
    if _ffi is None:
        return ("not_built",
                f"the compiled extension echo_jax._ffi is missing ({_import_error}): it is built "
                "when echo_jax is installed from source (a C++17 compiler; CMake and nanobind "
                f"come with the build); reinstall: {base.REINSTALL}")
    mismatch = build_mismatch(build_info(), "echo_jax._ffi")
    return None if mismatch is None else ("build_mismatch", mismatch)


def unavailable(axis_name=None, platform=None, devices=None) -> tuple[str, str] | None:
    """Why the CPU custom call cannot run, as (kind, sentence), or None when it can: the one
    check behind `unavailable_reason` and `echo_jax.transports.availability` (which lists the
    kinds).

    Args:
      axis_name: the axis to reduce over inside the trace here, if known.
      platform: the platform the call runs on (default: the trace's, `base.current_platform`).
      devices: instead of the trace, the devices of one mesh axis, for a call traced inside a
        `jax.shard_map` manual over it (`python -m echo_jax doctor` asks so).
    """
    found = module_reason()
    if found is not None:
        return found
    found = base.trace_or_processes(axis_name, devices, " and the CPU custom call shares host "
                                    "memory between the ranks of one process")
    if found is not None:
        return found
    if devices is not None and not 1 <= len(devices) <= MAX_RANKS:
        return ("ranks", f"the CPU custom call takes 1..{MAX_RANKS} ranks, the axis has "
                f"{len(devices)}")
    platform = base.current_platform() if platform is None else base.platform_name(platform)
    if platform not in available_platforms():
        return ("platform", f"echo_jax._ffi has no handler for platform {platform!r} (it has "
                f"{list(available_platforms())})")
    return None


def unavailable_reason(axis_name=None) -> str | None:
    """Why the CPU custom call cannot run here (None when it can): `unavailable`'s sentence.

    Args:
      axis_name: the axis to reduce over, if known; without it only the context is checked.
    """
    found = unavailable(axis_name)
    return None if found is None else found[1]


def limit_reason(config: EchoConfig, num_elements: int, num_ranks: int) -> str | None:
    """Why the CPU custom call's size limits rule this call out (None when within them).

    `_check_call` raises with it, and "auto" falls back to "xla" on it (so a call that "xla" can
    run never fails under "auto").

    Args:
      config: the call's EchoConfig (its group size).
      num_elements: elements of one rank's flat contribution.
      num_ranks: the size P of the reduced axis.
    """
    return base.limit_reason(config, num_elements, num_ranks, MAX_RANKS)


@contextlib.contextmanager
def debug_absent_rank(rank: int):
    """Test hook: calls *traced* inside this context make `rank` join its group and then leave
    without taking part, as a peer that never arrives would; the other ranks time out after
    ECHO_JAX_TIMEOUT_S with an error that names the stage, the group and the missing rank."""
    global _debug_absent_rank
    previous, _debug_absent_rank = _debug_absent_rank, int(rank)
    try:
        yield
    finally:
        _debug_absent_rank = previous


@contextlib.contextmanager
def debug_failing_rank(rank: int, cause: str, stage: str = "validate"):
    """Test hook: in calls *traced* inside this context, `rank` fails on purpose with `cause`,
    as a rank whose handler hits an error it knows about would.

    stage "validate": the rank's validation fails, before it joins its group; "push": it fails
    in the push stage, after it joined its group and wrote part of its contribution; "tail": it
    fails after its tail, when its peers have all they need from it for this call (they fail at
    their next call of the same call site in the execution). The rank raises an error with
    `cause`; the CPU handler tells its peers, which fail at once with "rank <rank> of the group
    failed (...): <cause>" instead of waiting for ECHO_JAX_TIMEOUT_S.
    """
    global _debug_failing
    if stage not in DEBUG_FAILING_STAGES:
        raise ValueError(f"debug_failing_rank: stage must be one of "
                         f"{sorted(DEBUG_FAILING_STAGES)}, got {stage!r}")
    previous, _debug_failing = _debug_failing, (int(rank), DEBUG_FAILING_STAGES[stage], str(cause))
    try:
        yield
    finally:
        _debug_failing = previous


def _coords(axis):
    """int32 [2]: this rank's index on `axis` and the id of its group (the other manual axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    rank = lax.axis_index(axis).astype(jnp.int32)
    group = jnp.int32(0)
    for name, size in zip(mesh.axis_names, mesh.axis_sizes):
        if name == axis or name not in mesh.manual_axes or size == 1:
            continue
        group = group * jnp.int32(size) + lax.axis_index(name).astype(jnp.int32)
    return jnp.stack([rank, jnp.broadcast_to(group, rank.shape).astype(jnp.int32)])


def _check_call(where, x_flat32, axis, num_ranks, config, states=()):
    """Validates a p2p call; returns the common attributes."""
    if not isinstance(config, EchoConfig):
        raise ValueError(f"{where}: config must be an EchoConfig, got {type(config).__name__}")
    shape, dtype = jnp.shape(x_flat32), jnp.result_type(x_flat32)
    if len(shape) != 1 or dtype not in DTYPES:
        raise ValueError(f"{where}: x_flat32 must be a flat float32, bfloat16 or float16 array, "
                         f"got {dtype}{list(shape)}; pass jnp.ravel(x) (cast other dtypes to "
                         "float32 first)")
    for name, m in states:
        want = jnp.dtype(config.state_dtype)
        if (isinstance(m, comp.QuantizedMoment)
                and config.state_dtype in base.QUANTIZED_STATE_DTYPES):
            # Codes of config.state_dtype for m1 and m2 alike: the call reads both in the
            # format of m1's codes and refuses a mix, so name the operand here.
            base.check_quantized_moment(where, name, m, shape[0], want)
            continue
        if (isinstance(m, comp.QuantizedMoment) or jnp.size(m) != shape[0]
                or jnp.result_type(m) != want):
            raise ValueError(f"{where}: {name} must be {want} with {shape[0]} elements (x_flat32's "
                             f"size, EchoConfig.state_dtype={config.state_dtype!r} for every dtype "
                             f"of x), got {jnp.result_type(m)}{list(jnp.shape(m))}; use the "
                             "CompensatorState from echo_jax.init_state(x, config)")
    if states and len({jnp.shape(base.state_codes(m)) for _, m in states}) != 1:
        raise ValueError(f"{where}: " + " and ".join(f"{name} {list(jnp.shape(m))}"
                                                     for name, m in states)
                         + " must have one shape (each is updated in place)")
    if (states and config.state_dtype in base.QUANTIZED_STATE_DTYPES
            and config.group_size != base.STATE_GROUP):
        raise ValueError(f"{where}: the {config.state_dtype} state needs group_size "
                         f"{base.STATE_GROUP} (a wire group is a state group), got "
                         f"{config.group_size}; use group_size={base.STATE_GROUP} or "
                         "state_dtype='bfloat16'")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
        raise ValueError(f"{where}: num_ranks must be an int, got {num_ranks!r}")
    num_ranks = int(num_ranks)
    try:
        size = lax.axis_size(axis)
    except NameError:
        raise ValueError(f"{where}: axis {axis!r} is not bound here; call it inside jax.shard_map "
                         f"over a mesh with an axis {axis!r}") from None
    if size != num_ranks:
        raise ValueError(f"{where}: num_ranks={num_ranks} but axis {axis!r} has size {size}")
    n = shape[0]
    reason = limit_reason(config, n, num_ranks)
    if reason is not None:
        raise ValueError(f"{where}: {reason} (axis {axis!r}); use transport='xla'")
    seg_groups, _ = base.segment_layout(n, num_ranks, config.group_size)
    if config.rotation == "hadamard" and not fused_rotation(config):
        raise ValueError(f"{where}: rotation='hadamard' needs a power-of-two group_size, got "
                         f"{config.group_size}")
    return dict(num_ranks=num_ranks, bits=int(config.bits), group_size=int(config.group_size),
                policy=POLICY_CODES[config.policy], segment_groups=int(seg_groups),
                site=next(_sites), timeout_ms=base.timeout_ms(),
                debug_absent_rank=int(_debug_absent_rank) if _debug_absent_rank < num_ranks
                else -1,
                debug_failing_rank=_debug_failing[0] if _debug_failing[0] < num_ranks else -1,
                debug_failing_stage=_debug_failing[1], debug_failure=_debug_failing[2],
                rotate=int(config.rotation == "hadamard"))


def allreduce(x_flat32, axis, num_ranks: int, config: EchoConfig, factor=None):
    """The quantized all-reduce of a flat contribution through the CPU custom call.

    Same arguments, result and bits as `echo_jax.transports.xla.allreduce`. Call it where
    `unavailable_reason(axis)` is None (`echo_jax.transports.select` checks it); the size limits
    are checked here, with errors that say what to fix.

    Args:
      x_flat32: [n] contribution of this rank (already compensated), float32, bfloat16 or
        float16; a 16-bit one goes into the call as it is (the arithmetic inside is fp32).
      axis: the bound axis name to reduce over.
      num_ranks: its size P.
      config: bits, group size, policy and rotation (rotation="hadamard": rotated inside the
        call, the bits of `echo_jax.transports.xla.allreduce` with the same config).
      factor: None, or the f32 power of two of the rescaling (the Echo paper Sec. 5.4): the
        call multiplies x by it on entry (the rotated x with the rotation) and divides the sum
        by it before the output (before the inverse rotation).

    Returns:
      [n] in x's dtype, identical on every rank (typed like lax.psum's result).
    """
    attrs = _check_call("p2p_allreduce", x_flat32, axis, num_ranks, config)
    _register(base.current_platform())
    n = jnp.shape(x_flat32)[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((n,), x_flat32.dtype),
                            vmap_method="sequential")
    coords = _coords(axis)
    y = call(x_flat32, coords, factor_operand(factor, coords), **attrs)
    return base.typed_like_psum(y, axis, x_flat32)


def allreduce_compensated(x_flat32, m1_flat, m2_flat, axis, num_ranks: int,
                          config: EchoConfig, factor=None):
    """Compensated all-reduce (Algorithm 1) fused into the CPU custom call.

    The apply step x' = x + eta (a m1 + (1 - a) m2) runs in the call's entry pass and the state
    update u = x' - y/P, m_j = beta_j m_j + (1 - beta_j) u inside the call once y is known; m1 and
    m2 are updated in place (input_output_aliases). Equal, bit for bit, to
    `comp.apply_correction` + `xla_allreduce` + `comp.update_state` on x.astype(f32), the sum
    then cast to x's dtype. With config.rotation="hadamard" the call rotates x' after the apply
    step and rotates the sum back before the update (the state stays in the original basis):
    the bits of apply + `echo_jax.transports.xla.allreduce` (rotated) + update.

    With config.residual="local" (no rotation) the averages (Eq. 11) take this rank's own
    rounding errors instead of u = x' - y/P (Eq. 4), and the call updates them where it
    quantizes, with no pass over x and the state after the sum: for an element of a segment it
    pushes, u = v - Q(v) with v = x' times the factor and Q(v) the value its owner decodes; for
    an element of the segment it owns, u = s - Q(s) with s the fp32 sum in rank order and Q(s)
    the value every rank decodes; each divided by the factor (exact). Summed over the ranks
    these are the error the Echo paper's residuals sum to (Eq. 4), up to the sum's fp32
    rounding. y is unchanged. The bits of `echo_jax.transports.xla.xla_allreduce_local` +
    `comp.update_with_residual`.

    Args:
      x_flat32: [n] contribution before correction, float32, bfloat16 or float16.
      m1_flat, m2_flat: the CompensatorState in config.state_dtype (`FUSED_STATE_DTYPES`), n
        elements in any shape, returned in that shape (keep the state's own shape: a reshape
        around an operand updated in place makes XLA copy it in a loop); a bfloat16 one is
        widened on load and the fp32 update rounded to nearest even on store; an int8 or
        int4 one (`compensator.QuantizedMoment`, group_size 128) read as codes times their
        group's scale and stored a group at a time with a new scale (`echo_jax.compensator`).
      axis, num_ranks, config, factor: as `allreduce`; the factor multiplies x' (after the
        apply step) and divides the sum before the update, so the state stays in x's units.

    Returns:
      (y [n] in x's dtype, identical on every rank, m1_new, m2_new in the state's dtype and
      shape); the state is updated with the fp32 sum, before its rounding to x's dtype.
    """
    attrs = _check_call("p2p_allreduce_compensated", x_flat32, axis, num_ranks, config,
                        states=(("m1_flat", m1_flat), ("m2_flat", m2_flat)))
    k = comp.Coefficients.from_config(config)
    _register(base.current_platform())
    n = jnp.shape(x_flat32)[0]
    y_type = jax.ShapeDtypeStruct((n,), x_flat32.dtype)
    # The state's arrays (an int8 or int4 state's codes and scales), each updated in place;
    # the int4 codes enter as XLA's packed int4 array (two a byte), which the call reads as is.
    state, types = base.state_operands(m1_flat, m2_flat)
    target = TARGET_COMPENSATED_Q8 if len(state) == 4 else TARGET_COMPENSATED
    call = jax.ffi.ffi_call(target, (y_type,) + types, vmap_method="sequential",
                            input_output_aliases={i + 1: i + 1 for i in range(len(state))})
    f32 = np.float32
    coords = _coords(axis)
    y, *new = call(x_flat32, *state, coords, factor_operand(factor, coords), **attrs,
                   ea=f32(k.ea), eb=f32(k.eb), b1=f32(k.b1), c1=f32(k.c1), b2=f32(k.b2),
                   c2=f32(k.c2), inv_p=f32(1.0 / int(num_ranks)),
                   residual_local=base.residual_local_attr(config))
    # ffi_call results are typed invariant; type them as the xla transport's are.
    varying = frozenset().union(*(_compat.varying_axes(o) for o in [x_flat32] + state))
    new = [_compat.to_varying(a, varying) for a in new]
    return (_compat.to_varying(y, varying - {axis}),) + base.state_from_arrays(new)


def allreduce_applied(x_flat32, m1_flat, m2_flat, axis, num_ranks: int, config: EchoConfig,
                      factor=None):
    """The apply step (Eq. 10) fused into the CPU custom call's entry pass, without the update.

    For `EchoConfig.state_update="separate"`: the call forms x' = x + eta (a m1 + (1 - a) m2)
    where it loads x and returns QAR(x') only; m1 and m2 are read, not written, and the update
    (`compensator.update_beside` on x, y and the state) runs after the call as its own op. The
    bits of y are those of `allreduce_compensated`'s y. config.residual must be "output": the
    local residual is taken inside the compensated call (`EchoConfig` pairs it with
    state_update="in_call").

    Args:
      x_flat32, m1_flat, m2_flat, axis, num_ranks, config, factor: as `allreduce_compensated`.

    Returns:
      y [n] in x's dtype, identical on every rank (typed like lax.psum's result).
    """
    attrs = _check_call("p2p_allreduce_applied", x_flat32, axis, num_ranks, config,
                        states=(("m1_flat", m1_flat), ("m2_flat", m2_flat)))
    if config.residual == "local":
        # The local residual exists only where the call quantizes; the applied call leaves the
        # update to an op after it, which sees x, y and the state only.
        raise ValueError("p2p_allreduce_applied: EchoConfig.residual='local' updates the state "
                         "inside the compensated call, and this call does not update it; use "
                         "allreduce_compensated, or residual='output'")
    k = comp.Coefficients.from_config(config)
    _register(base.current_platform())
    n = jnp.shape(x_flat32)[0]
    call = jax.ffi.ffi_call(TARGET_APPLIED, jax.ShapeDtypeStruct((n,), x_flat32.dtype),
                            vmap_method="sequential")
    f32 = np.float32
    coords = _coords(axis)
    y = call(x_flat32, m1_flat, m2_flat, coords, factor_operand(factor, coords), **attrs,
             ea=f32(k.ea), eb=f32(k.eb), b1=f32(k.b1), c1=f32(k.c1), b2=f32(k.b2), c2=f32(k.c2),
             inv_p=f32(1.0 / int(num_ranks)), residual_local=base.residual_local_attr(config))
    return base.typed_like_psum(y, axis, x_flat32, m1_flat, m2_flat)


def build_info() -> dict:
    """The XLA FFI headers echo_jax._ffi was compiled against: {"jaxlib": release or "unknown",
    "xla_ffi_api": (major, minor)}; empty without the extension. The install takes them from the
    jaxlib it runs with (CMakeLists.txt); reinstall (`pip install -e .`) after changing jaxlib."""
    return dict(_ffi.build_info()) if _ffi is not None else {}


def registry_stats() -> dict:
    """Counts of the CPU handler's persistent workspaces, joins in flight and bindings."""
    return dict(_ffi.registry_stats()) if _ffi is not None else {}


class CpuTransport(base.CustomCallTransport):
    """The CPU custom call (`echo_jax._ffi`, host threads over shared memory) as a
    `Transport`; it takes the state dtypes of FUSED_STATE_DTYPES."""

    name = NAME
    fused_state_dtypes = FUSED_STATE_DTYPES


#: This transport, as the object the call plan holds.
TRANSPORT = CpuTransport(sys.modules[__name__])

__all__ = ["TRANSPORT", "CpuTransport", "NAME", "TARGET_COMPENSATED_Q8", "unavailable", "unavailable_reason", "module_reason", "limit_reason",
           "allreduce", "allreduce_compensated", "allreduce_applied", "fused_rotation",
           "FUSED_STATE_DTYPES",
           "available_platforms", "debug_absent_rank", "debug_failing_rank", "factor_operand",
           "build_info", "registry_stats", "POLICY_CODES", "TARGET", "TARGET_COMPENSATED",
           "TARGET_APPLIED",
           "MAX_RANKS", "TIMEOUT_ENV"]
