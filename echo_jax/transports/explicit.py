"""The explicit entry points of the Echo custom call: `p2p_allreduce` and
`p2p_allreduce_compensated` on flat contributions.

`p2p_allreduce` has the signature of `echo_jax.collective.xla_allreduce` and returns the same
bits; `p2p_allreduce_compensated` fuses Algorithm 1 of the Echo paper into the call and returns
the same bits as `compensator.apply_correction` + `xla_allreduce` + `compensator.update_state`.
Both run the custom call of the platform (CPU or CUDA) where it can run, and fall back to the
"xla" transport where it cannot (e.g. under vmap), unless `config.transport == "p2p"`, which
raises instead; `config.transport == "xla"` does not stop them from running the custom call,
and the kill switch ECHO_JAX_FORCE_XLA does not apply. The rest is `echo_jax.transports.plan`'s
rules, as for `echo_psum`: the rotation inside the call where it rotates by itself, else in JAX
around it (the compensator then in JAX too); a state dtype the call does not take runs the
compensator in JAX around the call. The bits are the same either way.
"""

from __future__ import annotations

import jax.numpy as jnp

from echo_jax import compensator as comp
from echo_jax import transports
from echo_jax.config import EchoConfig
from echo_jax.transports import xla


def _plan(where, axis, config, x_flat, num_ranks, state_dtype=None) -> transports.CallPlan:
    """The plan of an explicit call: the custom call, or "xla" for the fallback."""
    if not isinstance(config, EchoConfig):
        raise ValueError(f"{where}: config must be an EchoConfig, got {type(config).__name__}")
    sized = jnp.ndim(x_flat) == 1
    requested = "p2p" if config.transport == "p2p" else "auto"
    return transports.plan(config, axis, int(jnp.shape(x_flat)[0]) if sized else None,
                           num_ranks=int(num_ranks) if sized else None, state_dtype=state_dtype,
                           rescale=False, transport=requested, where=where, honor_env=False)


def _allreduce(plan, x_flat, axis, num_ranks, factor):
    """The plan's uncompensated call, with the rotation in JAX around it where it says so."""
    if plan.rotation == "jax":
        return xla.rotated_allreduce(plan.transport.allreduce, x_flat, axis, num_ranks,
                                     plan.config, factor)
    return plan.transport.allreduce(x_flat, axis, num_ranks, plan.config, factor=factor)


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
    plan = _plan("p2p_allreduce", axis, config, x_flat32, num_ranks)
    return _allreduce(plan, x_flat32, axis, num_ranks, factor)


def p2p_allreduce_compensated(x_flat32, m1_flat, m2_flat, axis, num_ranks: int,
                              config: EchoConfig, factor=None):
    """Compensated all-reduce (Algorithm 1) fused into the custom call.

    The apply step x' = x + eta (a m1 + (1 - a) m2) runs in the call's entry pass and the state
    update u = x' - y/P, m_j = beta_j m_j + (1 - beta_j) u inside the call once y is known; m1 and
    m2 are updated in place (input_output_aliases). Equal, bit for bit, to
    `comp.apply_correction` + `xla_allreduce` + `comp.update_state` on x.astype(f32), the sum
    then cast to x's dtype (which is what runs where the plan does not fuse). The update always
    runs with the sum here (config.state_update is `echo_psum`'s choice).

    Args:
      x_flat32: [n] contribution before correction, float32, bfloat16 or float16 (passed to the
        call as it is).
      m1_flat, m2_flat: [n] in config.state_dtype (float32 or bfloat16), the flattened
        CompensatorState.
      axis, num_ranks, config, factor: as `p2p_allreduce`; the factor multiplies x' (after the
        apply step) and divides the sum before the update, so the state stays in x's units.

    Returns:
      (y [n] in x's dtype, identical on every rank, m1_new [n], m2_new [n] in the state's
      dtype); the state is updated with the fp32 sum, before its rounding to x's dtype.
    """
    where = "p2p_allreduce_compensated"
    if not isinstance(config, EchoConfig):
        raise ValueError(f"{where}: config must be an EchoConfig, got {type(config).__name__}")
    if config.state_dtype == "int8":
        raise ValueError(f"{where}: takes m1, m2 as float32 or bfloat16 arrays; an int8 state "
                         "(codes and scales) goes through echo_psum")
    for name, m in (("m1_flat", m1_flat), ("m2_flat", m2_flat)):
        if jnp.result_type(m) != jnp.dtype(config.state_dtype):
            raise ValueError(f"{where}: {name} must be {config.state_dtype} "
                             f"(EchoConfig.state_dtype), got {jnp.result_type(m)}")
    plan = _plan(where, axis, config.replace(state_update="in_call"), x_flat32, num_ranks,
                 config.state_dtype)
    if plan.compensation == "fused":
        return plan.transport.allreduce_compensated(x_flat32, m1_flat, m2_flat, axis, num_ranks,
                                                    plan.config, factor=factor)
    k = comp.Coefficients.from_config(config)
    state = comp.CompensatorState(m1_flat, m2_flat)
    x_prime = comp.apply_correction(x_flat32.astype(jnp.float32), state, k)
    y = _allreduce(plan, x_prime, axis, num_ranks, factor)
    new = comp.update_state(x_prime, y, num_ranks, state, k)
    return y.astype(x_flat32.dtype), new.m1, new.m2


__all__ = ["p2p_allreduce", "p2p_allreduce_compensated"]
