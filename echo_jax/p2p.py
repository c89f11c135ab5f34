"""The "p2p" transport as two explicit functions: the Echo custom call of this platform, "xla"
elsewhere.

The custom calls live in `echo_jax.transports.cpu` (XLA FFI handler of ffi/echo_allreduce_cpu.cc,
its attributes and limits documented there) and `echo_jax.transports.cuda` (ffi/p2p_cuda.cu);
`echo_jax.transports.select` decides which transport runs. This module keeps the explicit entry
points:

* `p2p_allreduce` has the signature of `echo_jax.collective.xla_allreduce` and returns the same
  bits; `p2p_allreduce_compensated` fuses Algorithm 1 of the Echo paper into the call and returns
  the same bits as `compensator.apply_correction` + `xla_allreduce` + `compensator.update_state`.
  Both run the custom call of the platform (CPU or CUDA) where it can run, and fall back to the
  "xla" transport where it cannot (e.g. under vmap), unless `config.transport == "p2p"`, which
  raises instead. `config.transport == "xla"` does not stop them from running the custom call.
  `config.rotation == "hadamard"` rotates inside the custom call where it rotates by itself
  (`transports.has_fused_rotation`; the compensated call stays fused), as `echo_psum` decides;
  otherwise in plain JAX around the unrotated call (`transports.xla.rotated_allreduce`, the
  factor multiplying x before the rotation, the compensator steps in JAX around it too). The
  bits are the same either way.

Every other name this module gives is a deprecated alias, which warns (DeprecationWarning) where
it is read and names its home (`DEPRECATED`): `choose` is
`echo_jax.transports.resolve(config, axis_name, num_elements, honor_env=False)`;
`unavailable_reason` and `limit_reason` are `echo_jax.transports`'; the build and registry
queries, the custom-call targets and the CPU call's limits are `echo_jax.transports.cpu`'s; the
timeout, the FFI version checks and the shared limits are `echo_jax.transports.base`'s.
"""

from __future__ import annotations

import importlib
import warnings

import jax.numpy as jnp

from echo_jax import compensator as comp
from echo_jax import transports
from echo_jax.config import EchoConfig
from echo_jax.transports import xla as _xla

#: Deprecated name -> the module that is its home (the name is the same there, except `choose`).
DEPRECATED = {
    "choose": "echo_jax.transports",
    **{name: "echo_jax.transports" for name in ("unavailable_reason", "limit_reason")},
    **{name: "echo_jax.transports.base" for name in (
        "DEFAULT_TIMEOUT_S", "MAX_GROUP_SIZE", "MAX_SEGMENT_ELEMS", "TIMEOUT_ENV",
        "build_mismatch", "factor_operand", "runtime_ffi_api")},
    **{name: "echo_jax.transports.cpu" for name in (
        "DEBUG_FAILING_STAGES", "DTYPES", "MAX_RANKS", "POLICY_CODES", "TARGET", "TARGET_APPLIED",
        "TARGET_COMPENSATED", "available_platforms", "build_info", "debug_absent_rank",
        "debug_failing_rank", "registry_stats")},
}


def _choose(config: EchoConfig, axis_name=None, num_elements=None) -> str:
    """The transport a call runs: "p2p" where the custom call can run, else "xla" (the
    environment's ECHO_JAX_FORCE_XLA aside)."""
    return transports.resolve(config, axis_name, num_elements, honor_env=False)


def __getattr__(name):
    """The deprecated aliases (PEP 562): a DeprecationWarning naming the home, then the value."""
    home = DEPRECATED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "choose":
        replacement = f"{home}.resolve(config, axis_name, num_elements, honor_env=False)"
        value = _choose
    else:
        replacement = f"{home}.{name}"
        value = getattr(importlib.import_module(home), name)
    warnings.warn(f"echo_jax.p2p.{name} is deprecated: use {replacement}", DeprecationWarning,
                  stacklevel=2)
    return value


def _select(where, axis, config, x_flat32, num_ranks):
    """The transport an explicit p2p call runs: the custom call, or "xla" for the fallback."""
    sized = isinstance(config, EchoConfig) and jnp.ndim(x_flat32) == 1
    requested = "p2p" if getattr(config, "transport", None) == "p2p" else "auto"
    return transports.select(config, axis, int(jnp.shape(x_flat32)[0]) if sized else None,
                             num_ranks=int(num_ranks) if sized else None, transport=requested,
                             where=where, honor_env=False)


def _rotation_in_jax(transport, config) -> bool:
    """Whether this call's rotation runs in JAX around `transport`: it cannot rotate itself
    (`collective.fused_rotation`'s rule)."""
    return (getattr(config, "rotation", "none") == "hadamard"
            and not transports.has_fused_rotation(transport, config))


def _allreduce(transport, x_flat, axis, num_ranks, config, factor):
    """`transport.allreduce`, with the rotation in JAX around it where `_rotation_in_jax`."""
    if _rotation_in_jax(transport, config):
        return _xla.rotated_allreduce(transport.allreduce, x_flat, axis, num_ranks, config,
                                      factor)
    return transport.allreduce(x_flat, axis, num_ranks, config, factor=factor)


def p2p_allreduce(x_flat32, axis, num_ranks: int, config: EchoConfig, factor=None):
    """The quantized all-reduce of a flat contribution through the Echo custom call.

    Same arguments, result and bits as `echo_jax.collective.xla_allreduce` (to which it falls
    back, for transport="auto", where the custom call cannot run, e.g. under vmap).

    Args:
      x_flat32: [n] contribution of this rank (already compensated), float32, bfloat16 or
        float16; a 16-bit one goes into the call as it is (the arithmetic inside is fp32).
      axis: the bound axis name to reduce over.
      num_ranks: its size P.
      config: bits, group size, policy and rotation.
      factor: None, or the f32 power of two of the rescaling (the Echo paper Sec. 5.4): the
        call multiplies x by it on entry and divides the sum by it before the output, as
        `echo_jax.collective.xla_allreduce_scaled` does (with the rotation: x before the
        rotation, and the sum after the inverse rotation).

    Returns:
      [n] in x's dtype, identical on every rank (typed like lax.psum's result): the fp32 sum
      rounded to x's dtype.
    """
    transport = _select("p2p_allreduce", axis, config, x_flat32, num_ranks)
    return _allreduce(transport, x_flat32, axis, num_ranks, config, factor)


def p2p_allreduce_compensated(x_flat32, m1_flat, m2_flat, axis, num_ranks: int,
                              config: EchoConfig, factor=None):
    """Compensated all-reduce (Algorithm 1) fused into the custom call.

    The apply step x' = x + eta (a m1 + (1 - a) m2) runs in the call's entry pass and the state
    update u = x' - y/P, m_j = beta_j m_j + (1 - beta_j) u inside the call once y is known; m1 and
    m2 are updated in place (input_output_aliases). Equal, bit for bit, to
    `comp.apply_correction` + `xla_allreduce` + `comp.update_state` on x.astype(f32), the sum
    then cast to x's dtype (which is what runs where the custom call cannot). With
    config.rotation="hadamard" the sum is the rotated one (`p2p_allreduce`) and the state stays
    in the original basis; the call stays fused where it rotates by itself. A bfloat16 state
    (config.state_dtype="bfloat16") is fused where the transport's call takes one
    (`transports.fused_state_dtypes`), else apply and update run in JAX around the call. The
    update always runs in the call here (config.state_update is `echo_psum`'s choice).

    Args:
      x_flat32: [n] contribution before correction, float32, bfloat16 or float16 (passed to the
        call as it is).
      m1_flat, m2_flat: [n] in config.state_dtype, the flattened CompensatorState.
      axis, num_ranks, config, factor: as `p2p_allreduce`; the factor multiplies x' (after the
        apply step) and divides the sum before the update, so the state stays in x's units.

    Returns:
      (y [n] in x's dtype, identical on every rank, m1_new [n], m2_new [n] in the state's
      dtype); the state is updated with the fp32 sum, before its rounding to x's dtype.
    """
    where = "p2p_allreduce_compensated"
    if not isinstance(config, EchoConfig):
        raise ValueError(f"{where}: config must be an EchoConfig, got {type(config).__name__}")
    for name, m in (("m1_flat", m1_flat), ("m2_flat", m2_flat)):
        if jnp.result_type(m) != jnp.dtype(config.state_dtype):
            raise ValueError(f"{where}: {name} must be {config.state_dtype} "
                             f"(EchoConfig.state_dtype), got {jnp.result_type(m)}")
    transport = _select(where, axis, config, x_flat32, num_ranks)
    if (config.state_dtype in transports.fused_state_dtypes(transport)
            and not _rotation_in_jax(transport, config)):
        return transport.allreduce_compensated(x_flat32, m1_flat, m2_flat, axis, num_ranks,
                                               config, factor=factor)
    k = comp.Coefficients.from_config(config)
    state = comp.CompensatorState(m1_flat, m2_flat)
    x_prime = comp.apply_correction(x_flat32.astype(jnp.float32), state, k)
    y = _allreduce(transport, x_prime, axis, num_ranks, config, factor)
    new = comp.update_state(x_prime, y, num_ranks, state, k)
    return y.astype(x_flat32.dtype), new.m1, new.m2


__all__ = ["p2p_allreduce", "p2p_allreduce_compensated"]
