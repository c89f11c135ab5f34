"""Megatron tensor-parallel operators with Echo at both sites (the Echo paper Sec. 5.4).

A Megatron block is  x -> backward_site -> column-parallel matmul -> ... -> row-parallel matmul
-> forward_site -> residual add.

* `forward_site` (Megatron's g): Echo all-reduce in the forward pass, identity in the backward
  pass. Its compensator state is threaded by the caller from site to site (e.g. through the carry
  of `nn.scan`) and reset to zeros at the start of each forward pass.
* `backward_site` (Megatron's f): identity in the forward pass, Echo all-reduce of the cotangent
  in the backward pass. Its compensator state needs no extra machinery: the caller threads a
  state pytree through the sites in the forward pass (the site returns it unchanged), and the
  backward pass carries the live state as the *cotangent* of that pytree, in backward order. The
  cotangent arriving at the last site is zero, so the backward state starts from zeros. The
  cotangent is rescaled by a shared power of two (one scalar pmax) around the all-reduce, the Echo
  paper's Sec. 5.4 scaling (its max |x| into [256, 512)): exact, and the bits of the unscaled call
  except for groups at the wire format's 2^-100 scale floor or 2^126 limit (echo_jax.quant); the
  compensator runs outside the scaling.

`config` selects the mode of a site: an `EchoConfig`, or None for the exact 16-bit baseline
(plain `lax.psum`) through the same code path. A tuple of them with a traced `choice` index
selects per layer inside a scanned stack (e.g. the early-site 8-bit policy of Sec. 7.2, or a
per-site policy calibrated by `models.calibrate`): the configs are static, the index is traced and
picks a `lax.switch` branch. The compensator state has the same shape under every config (bits,
group size and rotation only change the wire), so it flows between sites of different configs.

Beside the sites, a small internal API for the modules that build on them (`echo_jax.gspmd`,
`echo_jax.flax`): `check_site_configs` (the configs a site accepts), `site_all_reduce` (the one
reduction of a site under the config its `choice` picks) and `choice_cotangent` (the cotangent
of `choice` in a custom VJP).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from echo_jax import _compat, collective
from echo_jax.compensator import (CompensatorState, as_carrier, from_carrier, init_state,
                                  to_varying_state)
from echo_jax.config import EchoConfig

SiteConfig = Optional[EchoConfig]
SiteConfigs = Union[SiteConfig, Sequence[SiteConfig]]


def _reduce(x, axis, config: SiteConfig, state, rescale):
    """One all-reduce of `x` under a static site config; returns (y, state)."""
    if config is None:
        y = lax.psum(_compat.to_varying(x, axis), axis)
        return y, state
    if state is None or not config.compensated:
        return collective.echo_psum(x, axis, config=config, rescale=rescale), state
    return collective.echo_psum(x, axis, config=config, state=state, rescale=rescale)


def _reduce_site(x, axis, config: SiteConfig, state, rescale, exact_in_f32):
    """`_reduce`; with exact_in_f32 an exact (None) site sums a 16-bit x in fp32 and rounds once
    (what XLA:CPU's all-reduce does; the vmap simulation of a mixed site policy asks for it)."""
    if config is None and exact_in_f32 and jnp.dtype(x.dtype).itemsize < 4:
        y, state = _reduce(x.astype(jnp.float32), axis, None, state, rescale)
        return y.astype(x.dtype), state
    return _reduce(x, axis, config, state, rescale)


def site_all_reduce(x, axis, configs: SiteConfigs, choice, state, rescale: bool,
                    exact_in_f32: bool = False):
    """The all-reduce of one site under the config `choice` picks (the reduction both sites run).

    Internal API of the sites (`forward_site`, `backward_site`) and of `echo_jax.gspmd`'s
    column-parallel matmul; models call the sites instead.

    Args:
      x: this rank's value (per-rank code: `axis` is bound).
      axis: the tensor-parallel axis.
      configs: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them.
      choice: an int index into a tuple `configs` (may be traced: a `lax.switch` picks the
        branch; clipped to the tuple); ignored for a single config.
      state: the site's `CompensatorState` (shaped like x), or None (uncompensated).
      rescale: the power-of-two rescaling around the all-reduce.
      exact_in_f32: exact (None) configs sum a 16-bit x in fp32 and round once.

    Returns:
      (y, new_state): the sum over `axis`; the new state (None when `state` is None, `state`
      itself under an exact or uncompensated config).

    Raises:
      ValueError: a tuple of configs without a `choice`.
    """
    state = to_varying_state(state, axis)
    if not isinstance(configs, (tuple, list)):
        return _reduce_site(x, axis, configs, state, rescale, exact_in_f32)
    configs = tuple(configs)
    if choice is None:
        raise ValueError("a tuple of site configs needs a `choice` index")
    if len(configs) == 1:
        return _reduce_site(x, axis, configs[0], state, rescale, exact_in_f32)
    branches = [functools.partial(_branch, axis=axis, config=c, rescale=rescale,
                                  exact_in_f32=exact_in_f32) for c in configs]
    return lax.switch(jnp.clip(choice, 0, len(configs) - 1), branches, x, state)


def _branch(x, state, *, axis, config, rescale, exact_in_f32):
    y, s = _reduce_site(x, axis, config, state, rescale, exact_in_f32)
    return y, to_varying_state(s, axis)


def check_site_configs(configs: SiteConfigs, where: str) -> None:
    """Checks that a site's config (or each of a tuple) is an `EchoConfig` or None.

    Internal API of the sites and of the layers that call them (`echo_jax.gspmd`,
    `echo_jax.flax`), so a wrong config fails where it is given, with the caller's name.

    Args:
      configs: an `EchoConfig`, None, or a tuple / list of them.
      where: the caller, for the message.

    Raises:
      ValueError: a config that is neither an `EchoConfig` nor None.
    """
    for c in (configs if isinstance(configs, (tuple, list)) else (configs,)):
        if c is not None and not isinstance(c, EchoConfig):
            raise ValueError(f"{where}: a site config must be an EchoConfig or None (exact), "
                             f"got {type(c).__name__}")


# --------------------------------------------------------------------------------------------
# forward site (g): Echo forward, identity backward


def forward_site(x, axis_name, config: SiteConfigs, state: CompensatorState | None = None,
                 choice=None, rescale: bool = False, exact_in_f32: bool = False):
    """Row-parallel output reduction: y = Echo-all-reduce(x); the backward pass is identity.

    Args:
      x: this rank's partial output (float array).
      axis_name: the tensor-parallel axis.
      config: EchoConfig, None (exact psum), or a tuple of them selected by `choice`.
      state: forward compensator state (from `init_state(x)` or the previous site), or None.
      choice: int index into a tuple `config` (may be traced, e.g. the layer index).
      rescale: power-of-two rescaling around the all-reduce (off by default in forward).
      exact_in_f32: exact (None) configs sum a 16-bit x in fp32 and round once.

    Returns:
      (y, new_state); new_state is None when state is None.
    """
    check_site_configs(config, "forward_site")
    collective.axis_size(collective.single_axis(axis_name, "forward_site"), "forward_site")
    return _forward_site(x, state, choice, axis_name, config, rescale, bool(exact_in_f32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _forward_site(x, state, choice, axis, config, rescale, exact_in_f32):
    return site_all_reduce(x, axis, config, choice, state, rescale, exact_in_f32)


def _forward_site_fwd(x, state, choice, axis, config, rescale, exact_in_f32):
    return (_forward_site(x, state, choice, axis, config, rescale, exact_in_f32),
            (state, choice))


def _forward_site_bwd(axis, config, rescale, exact_in_f32, res, cts):
    state, choice = res
    ct_y, _ = cts
    # Identity: every rank receives the full cotangent of the (replicated) sum.
    ct_x = _compat.to_varying(ct_y, axis)
    zeros = jax.tree.map(jnp.zeros_like, state)
    return ct_x, zeros, choice_cotangent(choice)


_forward_site.defvjp(_forward_site_fwd, _forward_site_bwd)


def choice_cotangent(choice):
    """The cotangent of a site's `choice` index in a custom VJP: float0 zeros (an int has none).

    Internal API of the sites' VJPs (here and in `echo_jax.gspmd`).

    Args:
      choice: None or the int index a site was called with.

    Returns:
      None for None, else float0 zeros shaped like `choice`.
    """
    if choice is None:
        return None
    return jnp.zeros(jnp.shape(choice), jax.dtypes.float0)


# --------------------------------------------------------------------------------------------
# backward site (f): identity forward, Echo all-reduce of the cotangent backward


def backward_site(x, axis_name, config: SiteConfigs, bwd_state: CompensatorState,
                  choice=None, rescale: bool = True, exact_in_f32: bool = False):
    """Column-parallel input: identity forward; Echo all-reduce of the cotangent backward.

    Args:
      x: the replicated activation entering the column-parallel matmul.
      axis_name: the tensor-parallel axis.
      config: EchoConfig, None (exact psum), or a tuple of them selected by `choice`.
      bwd_state: a `CompensatorState` shaped like x (zeros from `init_state(x)`); thread the
        returned one to the next site. Its cotangent carries the backward compensator state.
        An int8 state (`EchoConfig.state_dtype="int8"`) comes back with its codes in
        `compensator.CODES_CARRIER` (the same bits in a float dtype, since an int8 array's
        cotangent holds no values), and its cotangent, the final backward state, likewise where
        the state was passed in that form (`compensator.as_carrier`; `from_carrier` reads it).
      choice: index into a tuple `config` (may be traced).
      rescale: power-of-two rescaling of the cotangent (Sec. 5.4); on by default.
      exact_in_f32: exact (None) configs sum a 16-bit cotangent in fp32 and round once.

    Returns:
      (x, bwd_state): both unchanged in value (an int8 state's codes in the carrier dtype); x
      typed as varying over the axis.
    """
    check_site_configs(config, "backward_site")
    collective.axis_size(collective.single_axis(axis_name, "backward_site"), "backward_site")
    if not isinstance(bwd_state, CompensatorState):
        raise ValueError("backward_site: bwd_state must be a CompensatorState shaped like x "
                         "(use echo_jax.init_state(x))")
    x_varies = _compat.varies_over(x, axis_name)
    # The live state is per rank, so its cotangent is varying: type the primal the same way.
    # An int8 state travels with its codes in a float carrier of the same bits (an int8 array's
    # cotangent is float0, which holds nothing).
    bwd_state = as_carrier(to_varying_state(bwd_state, axis_name))
    return _backward_site(x, bwd_state, choice, axis_name, config, rescale, x_varies,
                          bool(exact_in_f32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _backward_site(x, bwd_state, choice, axis, config, rescale, x_varies, exact_in_f32):
    return _compat.to_varying(x, axis), bwd_state


def _backward_site_fwd(x, bwd_state, choice, axis, config, rescale, x_varies, exact_in_f32):
    return (_backward_site(x, bwd_state, choice, axis, config, rescale, x_varies, exact_in_f32),
            (choice,))


def _backward_site_bwd(axis, config, rescale, x_varies, exact_in_f32, res, cts):
    (choice,) = res
    ct_x, live_state = cts
    live_state = from_carrier(live_state)  # an int8 state's codes as int8 again
    ct_in, new_state = site_all_reduce(ct_x, axis, config, choice, live_state, rescale,
                                      exact_in_f32)
    if x_varies:  # the cotangent of a varying input must be typed varying too
        ct_in = _compat.to_varying(ct_in, axis)
    if new_state is None:
        new_state = live_state
    return ct_in, as_carrier(new_state), choice_cotangent(choice)


_backward_site.defvjp(_backward_site_fwd, _backward_site_bwd)


def early_8bit_configs(config: EchoConfig) -> tuple:
    """(8-bit config, `config`) for the early-site policy: choose index 0 in the first half."""
    return (config.replace(bits=8), config)


def early_8bit_choice(layer, num_layers: int):
    """Index into `early_8bit_configs`: 0 (8-bit) for layer < num_layers / 2, else 1."""
    return jnp.where(layer < (num_layers + 1) // 2, 0, 1).astype(jnp.int32)


__all__ = ["forward_site", "backward_site", "early_8bit_configs", "early_8bit_choice",
           "init_state",
           # the internal API of the sites, for echo_jax.gspmd and echo_jax.flax
           "check_site_configs", "site_all_reduce", "choice_cotangent"]
