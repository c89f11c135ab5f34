"""The two-timescale error-feedback compensator (Algorithm 1 of the Echo paper, Sec. 5.1).

Per rank and per pass direction the state is a pair of fp32 averages (m1, m2) of the residuals
u = x' - y_hat / P left by earlier sites. At site k:

    c  = eta * (a * m1 + (1 - a) * m2)          Eq. 10, correction
    x' = x + c                                  apply (fused into the collective's entry pass)
    y  = QAR(x')                                the quantized all-reduce
    u  = x' - y / P                             Eq. 4: the residuals of the group sum to -delta
    m1 = beta1 * m1 + (1 - beta1) * u           Eq. 11
    m2 = beta2 * m2 + (1 - beta2) * u

Bit-exact arithmetic (shared with the custom call): every coefficient is computed in float64 from
the config and rounded once to fp32 (`Coefficients`); c = (eta*a)*m1 + (eta*(1-a))*m2; y/P is
y * f32(1/P); each rounded product is materialised before it meets an addition (no fused
multiply-add), in the order written above.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from echo_jax.config import EchoConfig
from echo_jax.quant import _no_fma


class CompensatorState(NamedTuple):
    """State of one compensated site sequence, per rank: fp32 arrays of x's per-rank shape."""

    m1: jax.Array
    m2: jax.Array


def init_state(x) -> CompensatorState:
    """Zero state for contributions shaped like `x` (an array, a ShapeDtypeStruct, or a pytree).

    For a pytree the result is a pytree of the same structure with a `CompensatorState` at each
    leaf, the form `echo_psum` takes for pytree inputs.
    """
    def one(leaf):
        z = jnp.zeros(jnp.shape(leaf), jnp.float32)
        return CompensatorState(z, z)

    return jax.tree.map(one, x)


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """fp32 constants of Algorithm 1, each rounded once from float64."""

    ea: np.float32     # eta * a
    eb: np.float32     # eta * (1 - a)
    b1: np.float32     # beta1
    c1: np.float32     # 1 - beta1
    b2: np.float32     # beta2
    c2: np.float32     # 1 - beta2

    @classmethod
    def from_config(cls, config: EchoConfig) -> "Coefficients":
        e, a = float(config.eta), float(config.blend)
        f = np.float32
        return cls(f(e * a), f(e * (1.0 - a)), f(config.beta1), f(1.0 - config.beta1),
                   f(config.beta2), f(1.0 - config.beta2))


def apply_correction(x32, state: CompensatorState, k: Coefficients):
    """x' = x + eta (a m1 + (1 - a) m2), in fp32 (Eq. 10)."""
    p1, p2 = _no_fma(k.ea * state.m1, k.eb * state.m2)
    return x32 + (p1 + p2)


def update_state(x_prime, y32, num_ranks: int, state: CompensatorState,
                 k: Coefficients) -> CompensatorState:
    """Residual u = x' - y/P and the two moving averages (Eq. 4 and Eq. 11), in fp32."""
    t = _no_fma(y32 * np.float32(1.0 / num_ranks))
    u = x_prime - t
    q1, r1, q2, r2 = _no_fma(k.b1 * state.m1, k.c1 * u, k.b2 * state.m2, k.c2 * u)
    return CompensatorState(q1 + r1, q2 + r2)


def check_state(state, x, where: str = "echo_psum") -> None:
    """Raise a ValueError that names the problem if `state` does not fit contribution `x`."""
    if not isinstance(state, CompensatorState):
        raise ValueError(
            f"{where}: state must be a CompensatorState(m1, m2) (see echo_jax.init_state), "
            f"got {type(state).__name__}")
    for name, arr in (("m1", state.m1), ("m2", state.m2)):
        if jnp.shape(arr) != jnp.shape(x):
            raise ValueError(f"{where}: state.{name} has shape {jnp.shape(arr)} but the "
                             f"contribution has shape {jnp.shape(x)}; use init_state(x)")
        if jnp.result_type(arr) != jnp.float32:
            raise ValueError(f"{where}: state.{name} must be float32, got {jnp.result_type(arr)}")


__all__ = ["CompensatorState", "init_state", "Coefficients", "apply_correction", "update_state"]
