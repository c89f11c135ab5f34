"""The "xla" transport: the Echo all-reduce in pure JAX (`lax.all_to_all` + an all-gather).

It runs everywhere (CPU, GPU, TPU, across hosts, and under `jax.vmap(..., axis_name=...)` with P
simulated ranks on one device) and is the reference of the custom calls, bit for bit. The
protocol is the one described in `echo_jax.collective`. It has no fused compensated call:
`echo_psum` runs the compensator's apply and update steps in JAX around `allreduce`.

Rotation: `allreduce` honours `config.rotation="hadamard"` with the rotation in plain JAX around
the quantized all-reduce (`rotated_allreduce`, the reference of the custom calls' fused rotation).
`fused_rotation` is False: nothing is fused here, so `echo_psum` keeps its own JAX rotation path
for this transport and hands it a config with rotation="none".
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from echo_jax import _compat
from echo_jax import quant
from echo_jax import rotation as rot
from echo_jax.config import EchoConfig
from echo_jax.transports.base import Transport, segment_layout

#: The value of `EchoConfig.transport` that names this transport.
NAME = "xla"


def unavailable_reason(axis_name=None) -> str | None:
    """Why this transport cannot run here: never (None).

    Args:
      axis_name: the axis to reduce over (unused: any bound mesh or vmap axis works).
    """
    del axis_name
    return None


def limit_reason(config: EchoConfig, num_elements: int, num_ranks: int) -> str | None:
    """Why a size limit rules this call out: never (None); the arguments are those of the
    custom calls' `limit_reason`."""
    del config, num_elements, num_ranks
    return None


def fused_rotation(config: EchoConfig) -> bool:
    """Whether this transport's call rotates by itself: never (False). `echo_psum` runs the
    rotation in JAX around it (`echo_jax.collective`) and passes it rotation="none".

    Args:
      config: the call's EchoConfig (unused).
    """
    del config
    return False


def rotated_allreduce(allreduce_fn, x_flat, axis, num_ranks: int, config: EchoConfig,
                      factor=None):
    """The rotated all-reduce in plain JAX around an unrotated all-reduce (`allreduce_fn`).

    x (widened to fp32 exactly) times `factor` (the rescaling's power of two, exact) is padded
    with zeros to whole groups of g, every group is rotated (`echo_jax.rotation.hadamard_rotate`),
    `allreduce_fn` sums the rotated values, the sum is rotated back, times 1 / factor (exact),
    cut to n and rounded to x's dtype. This is the definition the custom calls' fused rotation
    (attribute rotate = 1, the factor operand applied on entry and exit) follows bit for bit.

    Args:
      allreduce_fn: a transport's `allreduce` (x_flat, axis, num_ranks, config, factor=...); it
        gets `config` with rotation="none", no factor and an fp32 [ceil(n / g) * g] contribution.
      x_flat: [n] contribution (float32, bfloat16 or float16), already compensated.
      axis, num_ranks: the bound axis and its size P.
      config: bits, group size (a power of two) and policy; its rotation is ignored.
      factor: None, or the f32 power of two of the rescaling (`collective.rescale_factor` of x,
        with the rotation's headroom).

    Returns:
      [n] in x's dtype, identical on every rank.
    """
    dtype = jnp.result_type(x_flat)
    g = config.group_size
    n = x_flat.shape[0]
    padded = -(-max(n, 1) // g) * g
    x32 = x_flat.astype(jnp.float32)
    if factor is not None:
        f = jnp.asarray(factor, jnp.float32).reshape(())
        x32 = x32 * f
    xr = rot.hadamard_rotate(jnp.pad(x32, (0, padded - n)), g)
    plain = config if config.rotation == "none" else config.replace(rotation="none")
    y32 = rot.hadamard_unrotate(allreduce_fn(xr, axis, num_ranks, plain, factor=None), g)[:n]
    if factor is not None:
        y32 = y32 * (jnp.float32(1) / f)
    return y32.astype(dtype)


def xla_allreduce(x_flat32, axis, num_ranks: int, config: EchoConfig):
    """The quantized all-reduce of a flat contribution with the "xla" transport.

    Args:
      x_flat32: [n] contribution of this rank (already compensated): fp32, or bfloat16 /
        float16, which is widened to fp32 first (exactly).
      axis: the bound axis name to reduce over.
      num_ranks: its size P.
      config: bits, group size and policy.

    Returns:
      [n] in x's dtype (the fp32 sum, rounded to nearest even for a 16-bit x), identical on
      every rank.
    """
    dtype = jnp.result_type(x_flat32)
    if dtype != jnp.float32:
        return xla_allreduce(x_flat32.astype(jnp.float32), axis, num_ranks, config).astype(dtype)
    n = x_flat32.shape[0]
    _, _, _, sum_packed, sum_params = _push_and_reduce(x_flat32, axis, num_ranks, config)
    return _gather(sum_packed, sum_params, axis, config)[:n]


def _push_and_reduce(x32, axis, num_ranks: int, config: EchoConfig):
    """The push and the reduce of the protocol on an fp32 [n] contribution: (segs [P, per_seg,
    g] the padded segments, the pushed codes and parameters, the owned segment's fp32 sum's
    codes and parameters)."""
    bits, g, policy = config.bits, config.group_size, config.policy
    n = x32.shape[0]
    per_seg, padded = segment_layout(n, num_ranks, g)
    segs = jnp.pad(x32, (0, padded - n)).reshape(num_ranks, per_seg, g)
    # Push: quantize all P segments; the all-to-all delivers segment j of rank r as row r on j.
    packed, params = quant.quantize_groups(segs, bits, policy)
    recv_packed = lax.all_to_all(packed, axis, 0, 0)
    recv_params = lax.all_to_all(params, axis, 0, 0)
    copies = quant.dequantize_groups(recv_packed, recv_params, bits, policy)
    # Reduce: fp32 sum in rank order, own full-precision segment at its own position.
    me = lax.axis_index(axis)
    own = lax.dynamic_index_in_dim(segs, me, 0, keepdims=False)
    acc = jnp.where(me == 0, own, copies[0])
    for r in range(1, num_ranks):
        acc = acc + jnp.where(me == r, own, copies[r])
    sum_packed, sum_params = quant.quantize_groups(acc, bits, policy)
    return segs, (packed, params), acc, sum_packed, sum_params


def _gather(sum_packed, sum_params, axis, config: EchoConfig):
    """Gather + tail: every rank dequantizes the same codes of every owner, flat fp32 [padded].
    In a type-checked shard_map the gathered codes are invariant over the axis, like lax.psum's
    result."""
    all_packed = _compat.all_gather_invariant(sum_packed, axis)
    all_params = _compat.all_gather_invariant(sum_params, axis)
    return quant.dequantize_groups(all_packed, all_params, config.bits,
                                   config.policy).reshape(-1)


def xla_allreduce_local(x_flat32, axis, num_ranks: int, config: EchoConfig, factor=None):
    """`xla_allreduce_scaled` that also returns this rank's local residual
    (`EchoConfig.residual="local"`): the reference of the fused calls' update, bit for bit.

    With v = x' * factor (fp32; factor 1 when None), the residual of element k is

        (v_k - Q1(v)_k) / factor   for k in a segment this rank sends (the value its owner
                                   decodes: the push's rounding error),
        (s_k - Q2(s)_k) / factor   for k in the segment this rank owns (s: the fp32 sum in rank
                                   order, Q2(s): the decoded code every rank receives),

    one fp32 subtraction, then the exact product by 1 / factor. The own contribution enters the
    sum unquantized, so it has no push error. Summed over the ranks these are sum_r v_r - y_hat
    up to the sum's own fp32 rounding: the error the Echo paper's residuals x' - y_hat / P sum
    to (Eq. 4).

    Args:
      x_flat32: [n] contribution of this rank (already compensated), fp32 (a 16-bit one is
        widened exactly).
      axis, num_ranks: the bound axis and its size P.
      config: bits, group size and policy (rotation "none").
      factor: None, or the f32 power of two of the rescaling.

    Returns:
      (y32 [n] fp32, identical on every rank; u [n] fp32, this rank's residual).
    """
    x32 = jnp.asarray(x_flat32).astype(jnp.float32)
    bits, policy = config.bits, config.policy
    n = x32.shape[0]
    if factor is not None:
        f = jnp.asarray(factor, jnp.float32).reshape(())
        x32 = x32 * f
    segs, (packed, params), acc, sum_packed, sum_params = _push_and_reduce(x32, axis, num_ranks,
                                                                          config)
    sent = quant.dequantize_groups(packed, params, bits, policy)  # what each owner decodes
    own_y = quant.dequantize_groups(sum_packed, sum_params, bits, policy)
    ranks = lax.broadcasted_iota(jnp.int32, (num_ranks, 1, 1), 0)
    me = lax.axis_index(axis)
    err = jnp.where(ranks == me, (acc - own_y)[None], segs - sent)
    u = err.reshape(-1)[:n]
    y32 = _gather(sum_packed, sum_params, axis, config)[:n]
    if factor is not None:
        inv = jnp.float32(1) / f
        y32 = y32 * inv
        u = u * inv
    return y32, u


def xla_allreduce_scaled(x_flat32, axis, num_ranks: int, config: EchoConfig, factor=None):
    """`xla_allreduce` in units multiplied by `factor` (the Echo paper Sec. 5.4).

    The reference of the custom call's factor operand: x (widened to fp32) times the shared power
    of two, the quantized all-reduce, the fp32 sum times 1 / factor (both exact), then rounded to
    x's dtype. `factor` None: `xla_allreduce` itself.
    """
    if factor is None:
        return xla_allreduce(x_flat32, axis, num_ranks, config)
    dtype = jnp.result_type(x_flat32)
    f = jnp.asarray(factor, jnp.float32).reshape(())
    y32 = xla_allreduce(x_flat32.astype(jnp.float32) * f, axis, num_ranks, config)
    return (y32 * (jnp.float32(1) / f)).astype(dtype)


def _scaled(x_flat, axis, num_ranks, config, factor=None):
    return xla_allreduce_scaled(x_flat, axis, num_ranks, config, factor)


def allreduce(x_flat, axis, num_ranks: int, config: EchoConfig, factor=None):
    """The transport interface's all-reduce: `xla_allreduce_scaled`, rotated with
    config.rotation="hadamard" (`rotated_allreduce`, in JAX around it).

    Args:
      x_flat: [n] contribution (float32, bfloat16 or float16), already compensated.
      axis: the bound axis to reduce over; num_ranks: its size P.
      config: bits, group size, policy and rotation.
      factor: None, or the f32 power of two of the rescaling (with the rotation: applied
        before it and undone after the inverse rotation).

    Returns:
      [n] in x's dtype, identical on every rank.
    """
    if config.rotation == "hadamard":
        return rotated_allreduce(_scaled, x_flat, axis, num_ranks, config, factor)
    return xla_allreduce_scaled(x_flat, axis, num_ranks, config, factor)


class XlaTransport(Transport):
    """The pure-JAX transport as a `Transport`: runs everywhere, fuses nothing (the compensator
    and, where the plan says so, the rotation run in JAX around `allreduce`)."""

    name = NAME

    def unavailable(self, axis_name=None, platform=None, devices=None):
        del platform, devices
        reason = unavailable_reason(axis_name)
        return None if reason is None else ("context", reason)

    def limit_reason(self, config, num_elements, num_ranks):
        return limit_reason(config, num_elements, num_ranks)

    def allreduce(self, x_flat, axis, num_ranks, config, factor=None):
        return allreduce(x_flat, axis, num_ranks, config, factor)


#: This transport, as the object the call plan holds.
TRANSPORT = XlaTransport()

__all__ = ["TRANSPORT", "XlaTransport", "NAME", "unavailable_reason", "limit_reason", "allreduce", "fused_rotation",
           "rotated_allreduce", "xla_allreduce", "xla_allreduce_local", "xla_allreduce_scaled"]
