"""What the transports share: the wire layout, the custom calls' limits and context checks.

Nothing here imports another transport, so every transport module can import it (and
`echo_jax.transports.xla`) without a cycle.
"""

from __future__ import annotations

import abc
import functools
import os
import re
from typing import ClassVar

import jax
import jax.numpy as jnp

from echo_jax import _compat
from echo_jax import compensator as comp

#: Environment variable: seconds a rank waits for a peer before the call fails (default 10);
#: read by the CPU and the CUDA custom calls alike.
TIMEOUT_ENV = "ECHO_JAX_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0

#: Limits of the custom calls' attributes (ffi/echo_common.h has the same values).
MAX_GROUP_SIZE = 1 << 16
MAX_SEGMENT_ELEMS = 2 ** 31 - 1

_PLATFORM_ALIASES = {"cuda": "cuda", "gpu": "cuda", "rocm": "rocm", "cpu": "cpu"}

#: The install line that rebuilds the custom-call modules against the jaxlib installed now
#: (run in the echo_jax source folder; --no-deps keeps that jaxlib).
REINSTALL = "`pip install --force-reinstall --no-deps -e .` in the echo_jax source folder"


#: The state dtypes stored a value an element (not the int8 state's codes and scales).
WIDE_STATE_DTYPES = ("float32", "bfloat16")
#: Values of a quantized state (int8, int4) that share one scale.
STATE_GROUP = comp.STATE_GROUP
#: The state dtypes stored as codes and scales (`compensator.QuantizedMoment`).
QUANTIZED_STATE_DTYPES = ("int8", "int4")


def state_operands(m1, m2) -> tuple[list, tuple]:
    """A compensated call's state operands (after x) and their result types: [m1, m2], or a
    quantized state's [codes, scales] of each; every one is updated in place (operand and result
    i + 1 aliased, y being result 0)."""
    arrays = [a for m in (m1, m2) for a in (
        (m.codes, m.scales) if isinstance(m, comp.QuantizedMoment) else (m,))]
    return arrays, tuple(jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in arrays)


def state_codes(m):
    """The array of one average in x's element count (a quantized state's codes)."""
    return m.codes if isinstance(m, comp.QuantizedMoment) else m


def state_from_arrays(arrays) -> tuple:
    """`state_operands` undone: (m1, m2) from a call's 2 or 4 state results."""
    if len(arrays) == 4:
        return comp.QuantizedMoment(*arrays[:2]), comp.QuantizedMoment(*arrays[2:])
    return tuple(arrays)


def check_quantized_moment(where: str, name: str, m, n: int, dtype=jnp.int8) -> None:
    """Raises a ValueError naming `name` unless m is a quantized state average of n values
    (codes of `dtype`, int8 or int4, [n] in any shape, scales float32 [ceil(n / STATE_GROUP)])."""
    groups = comp.num_state_groups(n)
    codes, scales = m
    dtype = jnp.dtype(dtype)
    if (jnp.size(codes) != n or jnp.result_type(codes) != dtype
            or jnp.shape(scales) != (groups,) or jnp.result_type(scales) != jnp.float32):
        raise ValueError(
            f"{where}: {name} must be a QuantizedMoment of {dtype.name} codes with {n} elements and "
            f"float32 scales [{groups}], got codes {jnp.result_type(codes)}"
            f"{list(jnp.shape(codes))} and scales {jnp.result_type(scales)}"
            f"{list(jnp.shape(scales))}; use the CompensatorState from "
            "echo_jax.init_state(x, config)")


class Transport(abc.ABC):
    """One way to carry out the Echo protocol (the Echo paper Sec. 4): the interface every
    transport implements, as one object (`xla.TRANSPORT`, `cpu.TRANSPORT`, `cuda.TRANSPORT`).

    A transport returns the bits of the "xla" transport (the reference) on every rank.
    `echo_jax.transports.plan` asks these methods and attributes once per call site and passes
    the chosen object, inside a frozen `CallPlan`, to the code that traces the call.

    Capabilities are class attributes, so what a transport can fuse is read, never probed:

    * ``name``: the value of `EchoConfig.transport` that names it ("xla", or "p2p" for both
      custom calls).
    * ``custom_call``: True for the XLA FFI custom calls: x enters the call in its own dtype
      (fp32, bf16, fp16; the call widens it) and nothing around the call needs fp32.
    * ``fused_state_dtypes``: the state dtypes (`EchoConfig.state_dtype`) its
      `allreduce_compensated` takes; () where it has no fused compensated call. "int8" (a
      `compensator.QuantizedMoment` state) only with group_size STATE_GROUP: a wire group is
      then one state group, whose scale the call sets where it updates the group.
    * ``fused_apply``: whether it has `allreduce_applied` (the apply step alone in the call,
      `EchoConfig.state_update="separate"`), for the state dtypes above in WIDE_STATE_DTYPES.
    * ``separate_update``: whether it has `update_separate`, the separate update as one pass of
      its own (else the plan runs `compensator.update_beside`, in JAX), for the same dtypes.
    """

    name: ClassVar[str]
    custom_call: ClassVar[bool] = False
    fused_state_dtypes: ClassVar[tuple[str, ...]] = ()
    fused_apply: ClassVar[bool] = False
    separate_update: ClassVar[bool] = False

    @abc.abstractmethod
    def unavailable(self, axis_name=None, platform=None, devices=None) -> tuple[str, str] | None:
        """Why this transport cannot run here, as (kind, sentence with the fix), kinds from
        `echo_jax.transports.REASON_KINDS`; None where it can.

        Args:
          axis_name: the axis to reduce over inside the trace here, if known.
          platform: the platform asked about (default: the one a call traced here runs on).
          devices: instead of the trace, the devices of one mesh axis.
        """

    def unavailable_reason(self, axis_name=None) -> str | None:
        """`unavailable`'s sentence alone (None where the transport can run here)."""
        found = self.unavailable(axis_name)
        return None if found is None else found[1]

    @abc.abstractmethod
    def limit_reason(self, config, num_elements: int, num_ranks: int) -> str | None:
        """Why the call's size rules this transport out (None when within its limits).

        Args:
          config: the call's EchoConfig.
          num_elements: elements of one rank's flat contribution.
          num_ranks: the size P of the reduced axis.
        """

    @abc.abstractmethod
    def allreduce(self, x_flat, axis, num_ranks: int, config, factor=None):
        """The quantized all-reduce of a flat contribution, the sum in x's dtype.

        Args:
          x_flat: [n] this rank's contribution (float32; bfloat16 / float16 where
            ``custom_call``).
          axis: the bound axis to reduce over.
          num_ranks: its size P.
          config: the EchoConfig the call runs (rotation="hadamard" only where
            `fused_rotation(config)`).
          factor: None, or the f32 power of two of the rescaling (the Echo paper Sec. 5.4).

        Returns:
          [n] in x's dtype, the same bits on every rank and every transport.
        """

    def fused_rotation(self, config) -> bool:
        """Whether `allreduce` (and the fused calls) rotate by themselves for this config
        (the bits of `echo_jax.transports.xla.rotated_allreduce`); False: rotate in JAX."""
        return False

    def fused_state_reason(self, config, state_dtype: str) -> str | None:
        """Why the fused calls cannot take this state here beyond ``fused_state_dtypes`` (None
        where they can), as the end of "compensation in JAX: ...".

        Args:
          config: the call's EchoConfig.
          state_dtype: a dtype name of ``fused_state_dtypes``.
        """
        return None

    def allreduce_compensated(self, x_flat, m1, m2, axis, num_ranks: int, config, factor=None):
        """Algorithm 1 of the Echo paper fused into the call: (y, m1_new, m2_new). Only where
        ``fused_state_dtypes`` lists the state's dtype."""
        raise NotImplementedError(f"the {self.name!r} transport has no fused compensated call")

    def allreduce_applied(self, x_flat, m1, m2, axis, num_ranks: int, config, factor=None):
        """The apply step (Eq. 10) fused into the call's entry pass, y alone; m1, m2 only read.
        Only where ``fused_apply``."""
        raise NotImplementedError(f"the {self.name!r} transport has no applied call")

    def update_separate(self, x, y, state, num_ranks: int, config):
        """The separate update (x' from x and the state, u = x' - y / P, the two averages) in
        one pass: the bits of `compensator.update_beside`. Only where ``separate_update``."""
        raise NotImplementedError(f"the {self.name!r} transport has no separate update")

    def __repr__(self) -> str:
        return f"<echo_jax transport {self.name!r} ({type(self).__name__})>"


class CustomCallTransport(Transport):
    """A custom call as a `Transport`: the methods call the module-level functions of the
    transport module given (`unavailable`, `limit_reason`, `fused_rotation`, `allreduce`,
    `allreduce_compensated`, `allreduce_applied`: the CPU and CUDA calls' common interface).
    x enters the call in its own dtype; the compensator, the apply step alone and the rotation
    are fused into it."""

    custom_call = True
    fused_apply = True

    def __init__(self, calls):
        """Args: calls: the transport module whose functions run the calls."""
        self.calls = calls

    def unavailable(self, axis_name=None, platform=None, devices=None):
        return self.calls.unavailable(axis_name, platform=platform, devices=devices)

    def limit_reason(self, config, num_elements, num_ranks):
        return self.calls.limit_reason(config, num_elements, num_ranks)

    def fused_rotation(self, config):
        return self.calls.fused_rotation(config)

    def allreduce(self, x_flat, axis, num_ranks, config, factor=None):
        return self.calls.allreduce(x_flat, axis, num_ranks, config, factor=factor)

    def allreduce_compensated(self, x_flat, m1, m2, axis, num_ranks, config, factor=None):
        return self.calls.allreduce_compensated(x_flat, m1, m2, axis, num_ranks, config,
                                                factor=factor)

    def allreduce_applied(self, x_flat, m1, m2, axis, num_ranks, config, factor=None):
        return self.calls.allreduce_applied(x_flat, m1, m2, axis, num_ranks, config,
                                            factor=factor)


def segment_layout(num_elements: int, num_ranks: int, group_size: int):
    """The wire layout of the Echo protocol: P segments of Gs whole groups each.

    Args:
      num_elements: n, elements of one rank's flat contribution.
      num_ranks: P, the size of the reduced axis.
      group_size: g, values per quantization group.

    Returns:
      (groups per segment Gs = ceil(ceil(max(n, 1) / g) / P), padded length P * Gs * g).
    """
    groups = -(-max(num_elements, 1) // group_size)
    per_segment = -(-groups // num_ranks)
    return per_segment, num_ranks * per_segment * group_size


def typed_like_psum(y, axis, *operands):
    """y typed as varying over the operands' varying axes except `axis`, as `lax.psum`'s result
    is (an ffi_call's results are typed invariant; the "xla" transport's are typed this way).

    Args:
      y: a result of the all-reduce over `axis`.
      axis: the reduced axis.
      *operands: the call's operands whose varying axes y inherits.
    """
    varying = frozenset().union(*(_compat.varying_axes(o) for o in operands))
    return _compat.to_varying(y, varying - {axis})


def factor_operand(factor, like=None):
    """The custom calls' factor operand (CPU and CUDA): f32[1], the rescaling's power of two, 1
    when None.

    Args:
      factor: None or an f32 scalar (echo_jax.collective.rescale_factor).
      like: an operand whose varying mesh axes the factor takes (a shard_map type check wants
        the operands of one call typed alike).
    """
    f = jnp.ones((1,), jnp.float32) if factor is None else \
        jnp.reshape(jnp.asarray(factor, jnp.float32), (1,))
    if like is not None:
        f = _compat.to_varying(f, _compat.varying_axes(like))
    return f


def residual_local_attr(config) -> int:
    """The custom calls' attribute residual_local (CPU and CUDA, with the update's
    coefficients): 1 for `EchoConfig.residual="local"`, else 0."""
    return int(config.residual == "local")


def current_platform(mesh=None) -> str:
    """The platform a call traced here runs on ("cpu", "cuda", ...), from the abstract mesh's
    device where it has one, else JAX's default backend.

    Args:
      mesh: an abstract mesh (default: the one of the enclosing shard_map).
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) if device is not None else None
    if not platform:
        platform = jax.default_backend()
    return platform_name(platform)


def platform_name(platform) -> str:
    """A platform's name as `current_platform` gives it ("gpu" and "cuda" are "cuda").

    Args:
      platform: a platform name ("cpu", "gpu", "cuda", ...) or a jax Device.
    """
    platform = getattr(platform, "platform", platform)
    return _PLATFORM_ALIASES.get(str(platform).lower(), str(platform).lower())


def on_gpu() -> bool:
    """Whether a call traced here runs on an NVIDIA GPU."""
    return current_platform() in ("gpu", "cuda")


def context_reason(axis_name=None) -> str | None:
    """Why no custom call can run in this tracing context (None when the context allows one).

    A custom call needs one process, and a `jax.shard_map` in which the reduced axis and every
    other mesh axis of size > 1 are manual: under `jax.vmap(..., axis_name=...)` the ranks are
    batch entries of one device, and a call that waits for its peers would deadlock.

    Args:
      axis_name: the axis to reduce over, if known; without it only the context is checked.
    """
    if jax.process_count() > 1:
        return (f"this run has {jax.process_count()} processes and the CPU custom call shares "
                "host memory between the ranks of one process")
    return trace_reason(axis_name)


def trace_reason(axis_name=None) -> str | None:
    """`context_reason` without the process count: why the trace here (outside `jax.shard_map`,
    a vmap axis, mesh axes left automatic) rules a custom call out; None when it allows one.

    Args:
      axis_name: the axis to reduce over, if known; without it only the context is checked.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if mesh.empty or not manual:
        return ("it is not called inside jax.shard_map (the custom call needs one device per rank; "
                "under jax.vmap(..., axis_name=...) or outside shard_map only 'xla' runs)")
    if axis_name is not None and axis_name not in manual:
        return (f"axis {axis_name!r} is not a manual axis of the enclosing shard_map (manual: "
                f"{sorted(manual)}); a jax.vmap axis runs the 'xla' transport, since the vmapped "
                "ranks of a custom call would wait for each other forever")
    auto = [a for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a not in manual and s > 1]
    if auto:
        return (f"mesh axes {auto} are not manual inside this shard_map, so XLA would replicate "
                "the custom call over them; shard_map over every mesh axis of size > 1")
    return None



def trace_or_processes(axis_name, devices, processes_why: str) -> tuple[str, str] | None:
    """The custom calls' first checks, as `unavailable`'s (kind, sentence): the trace here
    ("context", `trace_reason`; skipped where `devices` names the group instead of a trace),
    then the process count ("processes": "this run has N processes" + `processes_why`, the
    transport's reason that one process must hold every rank). None where both allow a call.
    """
    if devices is None:
        reason = trace_reason(axis_name)
        if reason is not None:
            return ("context", reason)
    if jax.process_count() > 1:
        return ("processes", f"this run has {jax.process_count()} processes{processes_why}")
    return None

def limit_reason(config, num_elements: int, num_ranks: int, max_ranks: int) -> str | None:
    """Why a custom call's size limits rule this call out (None when it is within them).

    Args:
      config: the call's EchoConfig (its group size).
      num_elements: elements of one rank's flat contribution.
      num_ranks: the size P of the reduced axis.
      max_ranks: the custom call's limit on P.
    """
    if not 1 <= num_ranks <= max_ranks:
        return f"the custom call supports 1..{max_ranks} ranks, the axis has {num_ranks}"
    g = config.group_size
    if g > MAX_GROUP_SIZE:
        return (f"EchoConfig.group_size={g} exceeds the custom call's limit of "
                f"{MAX_GROUP_SIZE}")
    seg_groups, _ = segment_layout(num_elements, num_ranks, g)
    if seg_groups * g > MAX_SEGMENT_ELEMS:
        return (f"{num_elements} elements over {num_ranks} ranks make segments of "
                f"{seg_groups * g} elements, above the custom call's limit of 2^31-1; split the "
                "all-reduce")
    return None


def timeout_ms() -> int:
    """The bound on every wait for a peer (ECHO_JAX_TIMEOUT_S), read when a call is traced."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if raw.strip() == "":
        return int(DEFAULT_TIMEOUT_S * 1000)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0.001 <= seconds <= 86400.0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds in [0.001, 86400], "
                         f"got {raw!r}")
    return max(1, int(round(seconds * 1000)))


@functools.lru_cache(maxsize=None)
def runtime_ffi_api() -> tuple[int, int] | None:
    """(major, minor) XLA FFI API version of the running jaxlib, read from the headers it ships
    (`jax.ffi.include_dir()`); None where they cannot be read."""
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except (OSError, AttributeError):
        return None
    found = [re.search(rf"#define\s+XLA_FFI_API_{part}\s+(\d+)", text)
             for part in ("MAJOR", "MINOR")]
    return None if None in found else (int(found[0].group(1)), int(found[1].group(1)))


def build_mismatch(info: dict, module: str) -> str | None:
    """Why the running XLA would reject the handlers of a module built with these headers (None
    when it accepts them). XLA registers a handler of its own FFI API major version and a minor
    version up to its own: a module built against an older jaxlib's headers runs under a newer
    jaxlib, one built against a newer jaxlib's headers is refused by an older one.

    Args:
      info: the module's build_info() ({"jaxlib", "xla_ffi_api"}; empty: nothing to check).
      module: its name, for the message.
    """
    runtime = runtime_ffi_api()
    if not info or runtime is None:
        return None
    built = tuple(int(v) for v in info["xla_ffi_api"])
    if built[0] == runtime[0] and built[1] <= runtime[1]:
        return None
    import jaxlib
    return (f"{module} was compiled against the XLA FFI headers of jaxlib {info['jaxlib']} "
            f"(FFI API {built[0]}.{built[1]}), which this jaxlib {jaxlib.__version__} (FFI API "
            f"{runtime[0]}.{runtime[1]}) refuses; reinstall echo_jax with this jaxlib installed, "
            f"so that it is rebuilt against its headers: {REINSTALL}")


__all__ = ["Transport", "CustomCallTransport", "segment_layout", "typed_like_psum", "factor_operand", "residual_local_attr", "current_platform", "on_gpu",
           "platform_name", "context_reason", "trace_reason", "trace_or_processes",
           "limit_reason", "timeout_ms",
           "runtime_ffi_api", "build_mismatch", "REINSTALL",
           "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "MAX_GROUP_SIZE", "MAX_SEGMENT_ELEMS"]
