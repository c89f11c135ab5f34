"""The CUDA "p2p" transport: the Echo all-reduce as CUDA custom calls (module `echo_jax._ffi_cuda`).

The transport interface (`echo_jax.transports`): `unavailable_reason`, `limit_reason`, `allreduce`,
the fused `allreduce_compensated` and `allreduce_applied` (the apply step alone, for
`EchoConfig.state_update="separate"`), one rank per GPU inside `jax.shard_map`. Under them:

* `rank_allreduce`: one rank per GPU inside `jax.shard_map` (the "p2p" transport on GPUs). The
  group of GPUs of each rank is read from the concrete mesh, so call it under
  `jax.set_mesh(mesh)`; every GPU of a group must have peer access to the others.
* `virtual_allreduce`: P rank pipelines on P streams of one GPU, for tests and benchmarks on a
  machine with a single GPU. x is [P, ...]; row r is rank r's contribution.
* `quantize` / `dequantize`: the wire-format kernels on their own.

All of them return the same bits as the pure-JAX reference (`echo_jax.quant`,
`echo_jax.collective.xla_allreduce`, `echo_jax.compensator`). With `EchoConfig.rotation="hadamard"`
the all-reduce kernels rotate every group themselves (groups up to `MAX_ROTATED_GROUP`; the
reference is `echo_jax.transports.xla.rotated_allreduce`), compensated or not. The fused
compensated calls take the state in fp32, bfloat16, int8 or int4 (`FUSED_STATE_DTYPES`,
`EchoConfig.state_dtype`; int4 with `residual="local"` only): a bfloat16 m1, m2 is widened on
load and rounded to nearest even on store inside the kernels, an int8 or int4 one decoded and
encoded with its group's power-of-two scale, the bits of `echo_jax.compensator`'s state formats.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from echo_jax import _compat
from echo_jax import compensator as comp
from echo_jax import policies
from echo_jax.config import EchoConfig
from echo_jax.transports import base
from echo_jax.transports.base import TIMEOUT_ENV, build_mismatch, factor_operand

#: The value of `EchoConfig.transport` that selects the custom calls.
NAME = "p2p"

MAX_RANKS = 8

#: The largest group the kernels rotate themselves (`EchoConfig.rotation="hadamard"`); a larger
#: power-of-two group rotates in JAX around the call.
MAX_ROTATED_GROUP = 1024

POLICY_CODES = policies.CODES

#: The state dtypes (`EchoConfig.state_dtype`) the fused compensated kernels take. The int8 and
#: int4 states (a `QuantizedMoment`) run in the fast stages only (FastStages with S = int8_t, or
#: uint8_t for int4's packed codes): group_size 128, the update in the call, 16-byte aligned
#: buffers, `GENERIC_ENV` unset; the int4 state with `residual="local"` only (and virtual rows of
#: a multiple of 32 values). The plan checks the first two (`transports.call_modes`), the
#: others `CudaTransport.fused_state_reason`.
FUSED_STATE_DTYPES = ("float32", "bfloat16", "int8", "int4")
#: Set to anything but "" or "0", the handlers run the generic stages only (tests); read once
#: per process by the module.
GENERIC_ENV = "ECHO_JAX_GENERIC_QUANT"
#: The contribution dtypes of the calls and of `update_state`.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def timeout_ms() -> int:
    """The bound on every wait for a peer, read when a call is traced (same rule as on CPU)."""
    return base.timeout_ms()


@functools.lru_cache(maxsize=None)
def _module():
    from echo_jax import _ffi_cuda  # built by CMake when nvcc is found
    return _ffi_cuda


def available() -> bool:
    """Whether the CUDA handlers are built and a GPU is present."""
    try:
        _module()
    except ImportError:
        return False
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def build_info() -> dict:
    """The XLA FFI headers echo_jax._ffi_cuda was compiled against (as the CPU transport's
    `build_info()`), and the GPU architectures of its kernels under ARCHITECTURES_KEY where the
    build records them; empty when the CUDA handlers are not built."""
    try:
        return dict(_module().build_info())
    except ImportError:
        return {}


#: The key of `build_info()` that lists the GPU architectures compiled in (where the build
#: records them; `python -m echo_jax doctor` says "unknown" otherwise).
ARCHITECTURES_KEY = "cuda_architectures"

#: What builds the CUDA handlers: the install compiles them only where it finds a CUDA compiler.
BUILD_FIX = ("the install builds them only where it finds a CUDA compiler: nvcc on the PATH (or "
             "CUDACXX), or pip's CUDA toolkit in this environment (`pip install nvidia-cuda-nvcc "
             "nvidia-cuda-crt nvidia-cuda-cccl nvidia-cuda-runtime`); get one of them, then "
             "reinstall: " + base.REINSTALL + " (docs/install.md)")


def module_reason() -> tuple[str, str] | None:
    """Why the module echo_jax._ffi_cuda cannot serve a call, as (kind, sentence with the fix):
    it is not built or does not load ("not_built"), or the running jaxlib refuses it
    ("build_mismatch"); None when it is built and accepted. Needs no GPU."""
    try:
        _module()
    except ImportError as err:
        return ("not_built", f"the CUDA handlers (echo_jax._ffi_cuda) are not built or do not "
                f"load ({err}): {BUILD_FIX}")
    mismatch = build_mismatch(build_info(), "echo_jax._ffi_cuda")
    return None if mismatch is None else ("build_mismatch", mismatch)


def _local_gpu_ordinal(device) -> int | None:
    """The CUDA ordinal of a jax device that is a GPU of this process, else None."""
    if device.platform != "gpu" or device.process_index != jax.process_index():
        return None
    return int(device.local_hardware_id)


@functools.lru_cache(maxsize=None)
def _driver():
    """The CUDA driver library (libcuda), initialised; None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


@functools.lru_cache(maxsize=None)
def can_access_peer(device: int, peer: int) -> bool | None:
    """Whether GPU `device` can map the memory of GPU `peer` (CUDA ordinals of this process), as
    the driver says (cuDeviceCanAccessPeer); None where the driver cannot be asked."""
    lib = _driver()
    if lib is None:
        return None
    handles = [ctypes.c_int(), ctypes.c_int()]
    if any(lib.cuDeviceGet(ctypes.byref(h), int(o)) for h, o in zip(handles, (device, peer))):
        return None
    can = ctypes.c_int()
    if lib.cuDeviceCanAccessPeer(ctypes.byref(can), handles[0], handles[1]):
        return None
    return bool(can.value)


def peer_access_reason(groups) -> str | None:
    """Why the GPUs of a group cannot reach each other's memory, which the custom call writes
    into (None when every pair can, or the driver cannot be asked: the call checks it again).

    Args:
      groups: [groups, P] CUDA ordinals of the ranks of each group (`mesh_groups`).
    """
    for group in np.asarray(groups).reshape(-1, np.shape(groups)[-1]):
        for a in group:
            for b in group:
                if a != b and can_access_peer(int(a), int(b)) is False:
                    return (f"GPU {int(a)} has no peer access to GPU {int(b)} "
                            "(cuDeviceCanAccessPeer), and the CUDA custom call writes into its "
                            "peers' memory: reduce over GPUs that have it (NVLink, or PCIe "
                            "under one switch; `nvidia-smi topo -p2p r` lists them), or check "
                            "that the IOMMU / ACS settings or the container do not block "
                            "peer-to-peer")
    return None


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Registers the CUDA targets with XLA (once; after the GPU backend is initialised)."""
    jax.devices("gpu")
    for name, capsule in _module().registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _check(config: EchoConfig, num_ranks: int, where: str):
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"{where}: the CUDA custom call supports 1..{MAX_RANKS} ranks per group, "
                         f"got {num_ranks}; use transport='xla'")
    if config.rotation == "hadamard":
        if not fused_rotation(config):
            raise ValueError(f"{where}: the kernels rotate groups of at most {MAX_ROTATED_GROUP} "
                             f"values, got group_size={config.group_size}; echo_psum rotates "
                             "larger groups in JAX around the call")


def fused_rotation(config: EchoConfig) -> bool:
    """Whether the custom call rotates itself for `config` (`transports.has_fused_rotation`):
    every power-of-two group_size up to MAX_ROTATED_GROUP (EchoConfig checks the power of two)."""
    return config.group_size <= MAX_ROTATED_GROUP


def _attrs(config: EchoConfig, num_ranks: int, state: bool, applied: bool = False):
    # applied: the applied call's attributes (ea, eb only: it runs the apply step alone).
    a = dict(bits=np.int64(config.bits), group_size=np.int64(config.group_size),
             policy=np.int64(POLICY_CODES[config.policy]), num_ranks=np.int64(num_ranks),
             timeout_ms=np.int64(timeout_ms()),
             rotate=np.int64(config.rotation == "hadamard"))
    if state and applied:
        k = comp.Coefficients.from_config(config)
        a.update(ea=k.ea, eb=k.eb)
    elif state:
        k = comp.Coefficients.from_config(config)
        a.update(ea=k.ea, eb=k.eb, b1=k.b1, c1=k.c1, b2=k.b2, c2=k.c2,
                 inv_p=np.float32(1.0 / num_ranks),
                 residual_local=np.int64(base.residual_local_attr(config)))
    return a


def quantize(x, config: EchoConfig):
    """Flat x (whole groups) -> (packed uint8 [G, g*b/8], params uint16 [G, 1|2]) on the GPU,
    as `echo_jax.quant.quantize_groups` returns them (the bf16 scale's and fp16 zero-point's
    bits)."""
    register()
    g = config.group_size
    if x.size % g:
        raise ValueError(f"quantize: {x.size} values is not a multiple of group_size {g}")
    groups = x.size // g
    np_ = policies.num_params(config.policy)
    packed, params = jax.ffi.ffi_call(
        "echo_quantize_cuda",
        (jax.ShapeDtypeStruct((groups, g * config.bits // 8), jnp.uint8),
         jax.ShapeDtypeStruct((groups, np_), jnp.uint16)))(
        jnp.ravel(x), bits=np.int64(config.bits), group_size=np.int64(g),
        policy=np.int64(POLICY_CODES[config.policy]))
    return packed, params


def dequantize(packed, params, config: EchoConfig):
    """Inverse of `quantize`: fp32 [G * g]."""
    register()
    g = config.group_size
    return jax.ffi.ffi_call(
        "echo_dequantize_cuda", jax.ShapeDtypeStruct((packed.shape[0] * g,), jnp.float32))(
        packed, jnp.asarray(params, jnp.uint16), bits=np.int64(config.bits),
        group_size=np.int64(g), policy=np.int64(POLICY_CODES[config.policy]))


def virtual_allreduce(x, config: EchoConfig, state: comp.CompensatorState | None = None,
                      absent_rank: int = -1, factor=None):
    """P virtual ranks on one GPU: x [P, ...] -> y [P, ...] (and the new state [P, ...]).

    Same bits as `jax.vmap(echo_psum, axis_name=...)` with transport "xla". `absent_rank` (tests
    only) leaves one rank out, so the others must time out; the group is unusable afterwards.
    `factor`: None, or the rescaling's shared power of two (every rank's; see
    `echo_jax.collective.rescale_factor`), applied inside the kernels. With a state and
    `config.state_update="separate"` the applied call runs (the apply step inside, m1, m2 only
    read) and the update after it, `compensator.update_beside` on the stream of
        `update_state` (one pass), as `echo_psum` does.
    """
    register()
    num_ranks = x.shape[0]
    _check(config, num_ranks, "virtual_allreduce")
    flat = x.reshape(num_ranks, -1)
    y_type = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    if state is None:
        y = jax.ffi.ffi_call("echo_allreduce_virtual_cuda", y_type)(
            flat, factor_operand(factor), absent_rank=np.int64(absent_rank),
            **_attrs(config, num_ranks, False))
        return y.reshape(x.shape)
    if isinstance(state, comp.CompensatorState) and state.quantized:  # per row: [P, groups]
        comp.check_state(jax.tree.map(lambda a: a[0], state), x[0], "virtual_allreduce", config)
    else:
        comp.check_state(state, x, "virtual_allreduce", config)
    if config.state_update == "separate" and state.quantized:
        raise ValueError("virtual_allreduce: the applied call (state_update='separate') takes no "
                         "quantized (int8 / int4) state; use state_update='in_call'")
    if config.state_update == "separate":
        y = jax.ffi.ffi_call("echo_allreduce_virtual_applied_cuda", y_type)(
            flat, state.m1.reshape(flat.shape), state.m2.reshape(flat.shape),
            factor_operand(factor), **_attrs(config, num_ranks, True, applied=True))
        y = y.reshape(x.shape)
        return y, update_state(x, y, state, num_ranks, config)
    if state.quantized:  # codes [P, n] and scales [P, groups of a row], each updated in place
        arrays, types = base.state_operands(
            *(jax.tree.map(lambda a: a.reshape(num_ranks, -1), m) for m in state))
        y, *new = jax.ffi.ffi_call(
            "echo_allreduce_virtual_comp_q8_cuda", (y_type,) + types,
            input_output_aliases={i: i for i in range(1, 5)})(
            flat, *arrays, factor_operand(factor), **_attrs(config, num_ranks, True))
        m1, m2 = base.state_from_arrays(new)
        shaped = [comp.QuantizedMoment(m.codes.reshape(x.shape), m.scales.reshape(
            jnp.shape(old.scales))) for m, old in zip((m1, m2), state)]
        return y.reshape(x.shape), comp.CompensatorState(*shaped)
    m_type = jax.ShapeDtypeStruct(flat.shape, jnp.result_type(state.m1))
    y, m1, m2 = jax.ffi.ffi_call(
        "echo_allreduce_virtual_comp_cuda", (y_type, m_type, m_type),
        input_output_aliases={1: 1, 2: 2})(
        flat, state.m1.reshape(flat.shape), state.m2.reshape(flat.shape), factor_operand(factor),
        **_attrs(config, num_ranks, True))
    return y.reshape(x.shape), comp.CompensatorState(m1.reshape(x.shape), m2.reshape(x.shape))


def update_state(x, y, state: comp.CompensatorState, num_ranks: int, config: EchoConfig):
    """The separate update (`EchoConfig.state_update="separate"`) as one CUDA kernel pass.

    The arithmetic and bits of `compensator.update_beside` (x' recomputed from x, m1, m2 by
    Eq. 10; u = x' - y / P, Eq. 4; the two averages, Eq. 11): each value of x, y, m1, m2 read
    once, m1 and m2 written once, in place (input_output_aliases), where the JAX reference
    takes several passes (its barriers against fused multiply-adds split XLA's fusion).
    Elementwise: any shape, inside shard_map per rank or over virtual ranks [P, ...] at once.

    Args:
      x: the contribution before correction (float32, bfloat16 or float16).
      y: the all-reduce's result for x' (x's shape and dtype).
      state: the state the call read, in config.state_dtype (float32 or bfloat16), x's size.
      num_ranks: P.
      config: the call's EchoConfig (its coefficients).

    Returns:
      The new CompensatorState, in the state's dtype and shape.
    """
    register()
    if jnp.result_type(x) not in DTYPES or jnp.result_type(y) != jnp.result_type(x):
        raise ValueError(f"update_state: x and y must be one of {[str(d) for d in DTYPES]} and "
                         f"of one dtype, got {jnp.result_type(x)} and {jnp.result_type(y)}")
    comp.check_state(state, state.m1, "update_state", config)
    if not jnp.size(x) == jnp.size(y) == jnp.size(state.m1):
        raise ValueError(f"update_state: x, y and the state must have one size, got "
                         f"{jnp.size(x)}, {jnp.size(y)} and {jnp.size(state.m1)}")
    k = comp.Coefficients.from_config(config)
    f32 = np.float32
    m_type = jax.ShapeDtypeStruct(jnp.shape(state.m1), jnp.result_type(state.m1))
    m1, m2 = jax.ffi.ffi_call("echo_state_update_cuda", (m_type, m_type),
                              input_output_aliases={2: 0, 3: 1}, vmap_method="broadcast_all")(
        x, y, state.m1, state.m2, ea=f32(k.ea), eb=f32(k.eb), b1=f32(k.b1), c1=f32(k.c1),
        b2=f32(k.b2), c2=f32(k.c2), inv_p=f32(1.0 / int(num_ranks)))
    varying = frozenset().union(*(_compat.varying_axes(o) for o in (x, y, state.m1, state.m2)))
    return comp.CompensatorState(_compat.to_varying(m1, varying), _compat.to_varying(m2, varying))


def mesh_groups(axis, num_ranks: int) -> np.ndarray | None:
    """Local device ordinals of every group along `axis` of the concrete mesh, [groups, P].

    None when no concrete mesh is set (use `jax.set_mesh(mesh)`), or when a device of the mesh
    is not a local GPU.
    """
    mesh = _compat.concrete_mesh()  # the concrete mesh of jax.set_mesh
    if mesh is None or not mesh.shape or axis not in mesh.axis_names:
        return None
    ordinals = np.vectorize(_local_gpu_ordinal, otypes=[object])(mesh.devices)
    if any(o is None for o in ordinals.flat):
        return None
    ordinals = np.moveaxis(ordinals, mesh.axis_names.index(axis), -1).reshape(-1, num_ranks)
    return ordinals.astype(np.int64)


def rank_allreduce(x, axis, num_ranks: int, config: EchoConfig, state=None, factor=None,
                   applied=False):
    """One rank's Echo all-reduce on its GPU, inside shard_map (under `jax.set_mesh`); `factor`
    as in `virtual_allreduce` (the same on every rank: it comes from a pmax). With a state:
    (y, new state) from the compensated call, or y alone from the applied call (`applied`:
    the apply step only, the state read and not updated)."""
    register()
    _check(config, num_ranks, "rank_allreduce")
    groups = mesh_groups(axis, num_ranks)
    if groups is None:
        raise ValueError("transport='p2p' on GPUs needs the concrete mesh: call inside "
                         "`with jax.set_mesh(mesh):` over local GPUs, or use transport='auto'")
    attrs = _attrs(config, num_ranks, state is not None, applied)
    attrs["groups"] = groups.reshape(-1)
    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if state is None:
        f = factor_operand(factor, like=x)
        return jax.ffi.ffi_call("echo_allreduce_cuda", y_type)(x, f, **attrs)
    # The state keeps its own shape (x may be flat): reshaping an operand the call updates in
    # place makes XLA copy it in a loop.
    comp.check_state(state, base.state_codes(state.m1), "rank_allreduce", config)
    if jnp.size(base.state_codes(state.m1)) != jnp.size(x):
        raise ValueError(f"rank_allreduce: the state has {jnp.size(base.state_codes(state.m1))} "
                         f"elements, x has {jnp.size(x)}; use echo_jax.init_state(x, config)")
    if state.quantized:  # codes and scales, each updated in place
        if applied:
            raise ValueError("rank_allreduce: the applied call takes no quantized (int8 / int4) "
                             "state")
        arrays, types = base.state_operands(*state)
        y, *new = jax.ffi.ffi_call("echo_allreduce_comp_q8_cuda", (y_type,) + types,
                                   input_output_aliases={i: i for i in range(1, 5)})(
            x, *arrays, factor_operand(factor, like=x), **attrs)
        return y, comp.CompensatorState(*base.state_from_arrays(new))
    if applied:
        return jax.ffi.ffi_call("echo_allreduce_applied_cuda", y_type)(
            x, state.m1, state.m2, factor_operand(factor, like=x), **attrs)
    m_type = jax.ShapeDtypeStruct(jnp.shape(state.m1), jnp.result_type(state.m1))
    y, m1, m2 = jax.ffi.ffi_call("echo_allreduce_comp_cuda", (y_type, m_type, m_type),
                                 input_output_aliases={1: 1, 2: 2})(
        x, state.m1, state.m2, factor_operand(factor, like=x), **attrs)
    return y, comp.CompensatorState(m1, m2)


def unavailable(axis_name=None, platform=None, devices=None) -> tuple[str, str] | None:
    """Why the CUDA custom call cannot run, as (kind, sentence with the fix), or None when it
    can: the one check behind `unavailable_reason` and `echo_jax.transports.availability`
    (which lists the kinds). In order: the trace ("context": outside shard_map, a vmap axis),
    the process count ("processes"), the module (`module_reason`), then the group: at most
    MAX_RANKS ranks ("ranks"), every rank a GPU of this process in the concrete mesh ("mesh"),
    peer access between them ("peer_access").

    Args:
      axis_name: the axis to reduce over inside the trace here, if known.
      platform: unused (the caller chose this transport for an NVIDIA GPU platform).
      devices: instead of the trace, the devices of one mesh axis, for a call traced inside a
        `jax.shard_map` manual over it, under `jax.set_mesh` (`python -m echo_jax doctor`).
    """
    del platform
    found = base.trace_or_processes(
        axis_name, devices, ", and the CUDA custom call finds the peers of a rank among the GPUs "
        "of its own process: run one process that holds every GPU of the mesh (no "
        "jax.distributed), or use transport='xla' (or lax.psum) across processes")
    if found is not None:
        return found
    found = module_reason()
    if found is not None:
        return found
    if devices is None and axis_name is None:
        return None
    if devices is None:
        size = jax.sharding.get_abstract_mesh().shape[axis_name]
    else:
        size = len(devices)
    if not 1 <= size <= MAX_RANKS:
        return ("ranks", f"the CUDA custom call takes 1..{MAX_RANKS} ranks, the axis has {size}: "
                f"reduce over a mesh axis of at most {MAX_RANKS} GPUs")
    if devices is None:
        groups = mesh_groups(axis_name, size)
    else:
        ordinals = [_local_gpu_ordinal(d) for d in devices]
        groups = None if None in ordinals else np.asarray([ordinals], np.int64)
    if groups is None:
        return ("mesh", "the CUDA custom call finds the GPUs of each group in the concrete mesh, "
                "and every device of it must be a GPU of this process: call it under "
                "`with jax.set_mesh(mesh):` (a mesh passed to jax.shard_map alone is not "
                "enough)")
    reason = peer_access_reason(groups)
    return None if reason is None else ("peer_access", reason)


def unavailable_reason(axis_name=None) -> str | None:
    """Why the CUDA custom call cannot run here (None when it can): `unavailable`'s sentence,
    and that the call runs on NVIDIA GPUs only.

    Args:
      axis_name: the axis to reduce over, if known; with it the group size and the concrete
        mesh are checked too.
    """
    reason = base.trace_reason(axis_name)
    if reason is not None:
        return reason
    if not base.on_gpu():
        return f"the CUDA custom call runs on NVIDIA GPUs, this call on {base.current_platform()!r}"
    found = unavailable(axis_name)
    return None if found is None else found[1]


def limit_reason(config: EchoConfig, num_elements: int, num_ranks: int) -> str | None:
    """Why the CUDA custom call's size limits rule this call out (None when within them).

    Args:
      config: the call's EchoConfig (its group size).
      num_elements: elements of one rank's flat contribution.
      num_ranks: the size P of the reduced axis.
    """
    return base.limit_reason(config, num_elements, num_ranks, MAX_RANKS)


def allreduce(x_flat, axis, num_ranks: int, config: EchoConfig, factor=None):
    """The transport interface's all-reduce on GPUs: `rank_allreduce`, typed like lax.psum's
    result (arguments and bits as `echo_jax.transports.xla.allreduce`)."""
    y = rank_allreduce(x_flat, axis, num_ranks, config, factor=factor)
    return base.typed_like_psum(y, axis, x_flat)


def allreduce_compensated(x_flat, m1_flat, m2_flat, axis, num_ranks: int, config: EchoConfig,
                          factor=None):
    """The fused compensated all-reduce on GPUs (arguments and results as
    `echo_jax.transports.cpu.allreduce_compensated`)."""
    # ffi_call results are typed invariant; type them as the xla transport's are.
    varying = frozenset().union(*(_compat.varying_axes(o) for o in
                                  jax.tree.leaves((x_flat, m1_flat, m2_flat))))
    y, new = rank_allreduce(x_flat, axis, num_ranks, config,
                            comp.CompensatorState(m1_flat, m2_flat), factor=factor)
    new = jax.tree.map(lambda a: _compat.to_varying(a, varying), new)
    return (_compat.to_varying(y, varying - {axis}), new.m1, new.m2)


def allreduce_applied(x_flat, m1_flat, m2_flat, axis, num_ranks: int, config: EchoConfig,
                      factor=None):
    """The apply step alone fused into the call on GPUs (`EchoConfig.state_update="separate"`;
    arguments and result as `echo_jax.transports.cpu.allreduce_applied`)."""
    y = rank_allreduce(x_flat, axis, num_ranks, config, comp.CompensatorState(m1_flat, m2_flat),
                       factor=factor, applied=True)
    return base.typed_like_psum(y, axis, x_flat, m1_flat, m2_flat)


class CudaTransport(base.CustomCallTransport):
    """The CUDA custom calls (`echo_jax._ffi_cuda`, one GPU per rank, peer-to-peer writes) as
    a `Transport`; it takes the state dtypes of FUSED_STATE_DTYPES and runs the separate update
    as one kernel pass (`update_state`)."""

    name = NAME
    fused_state_dtypes = FUSED_STATE_DTYPES
    separate_update = True

    def update_separate(self, x, y, state, num_ranks, config):
        return update_state(x, y, state, num_ranks, config)

    def fused_state_reason(self, config, state_dtype):
        if config.residual == "local" and state_dtype not in ("int8", "int4"):
            return (f"the CUDA call takes the local residual (residual='local') with the int8 "
                    f"or int4 state only, got a {state_dtype} state (use state_dtype='int8' or "
                    f"'int4')")
        if state_dtype == "int4" and config.residual != "local":
            return "the call takes the int4 state with residual='local' only"
        if (state_dtype in ("int8", "int4")
                and os.environ.get(GENERIC_ENV, "") not in ("", "0")):
            return (f"the call's {state_dtype} state runs in the fast stages only, and "
                    f"{GENERIC_ENV} asks for the generic ones (unset it)")
        return None


#: This transport, as the object the call plan holds.
TRANSPORT = CudaTransport(sys.modules[__name__])

__all__ = ["TRANSPORT", "CudaTransport", "update_state", "DTYPES", "NAME", "unavailable", "unavailable_reason", "module_reason", "peer_access_reason",
           "can_access_peer", "ARCHITECTURES_KEY", "BUILD_FIX", "limit_reason", "allreduce",
           "allreduce_compensated", "allreduce_applied",
           "fused_rotation", "MAX_ROTATED_GROUP", "FUSED_STATE_DTYPES", "available", "build_info",
           "register",
           "quantize", "dequantize", "virtual_allreduce",
           "rank_allreduce", "mesh_groups", "MAX_RANKS", "TIMEOUT_ENV", "POLICY_CODES",
           "GENERIC_ENV"]
