"""A Qwen3 / Llama decoder in Flax, tensor-parallel (Megatron) with Echo at every site.

Read it top to bottom: building blocks (RMSNorm, RoPE, attention), one decoder layer for one
rank, the scanned stack, then parameters (init, shard, unshard), the runners (shard_map over the
"tp" mesh axis, or vmap simulation of P ranks on one device), the loss, training and KV-cache
decoding, and last an unsharded plain-jnp reference used by the parity tests.

Architecture (one layer, pre-norm):

    h = h + O(attention(RoPE(qk_norm(Q x)), RoPE(qk_norm(K x)), V x)),   x = RMSNorm(h)
    h = h + Down(silu(Gate x) * Up x),                                    x = RMSNorm(h)

with grouped-query attention (n_kv_heads <= n_heads), HF's "rotate_half" RoPE convention, QK-norm
for Qwen3 (`qk_norm=True`) and none for Llama, tied or untied embeddings.

Tensor parallelism (Megatron, one rank's shard; P = CommConfig.tp). Every rank holds:
  * column shards of Q, K, V (its n_heads/P query heads and n_kv_heads/P KV heads, contiguous, so
    the GQA grouping stays inside the rank) and of Gate, Up (ffn_dim/P columns);
  * the matching row shards of O and Down;
  * a full copy of everything else: the norms, the token embedding and the LM head (replicated:
    the simplest choice; a vocab-parallel head would save memory but add collectives outside the
    2-per-layer count of the paper). The QK-norm scales act on local heads only, so their
    gradients are summed over the ranks (an exact psum of 2 * head_dim values per layer).
Each block (attention, MLP) starts with `tp.backward_site` (f: identity forward, all-reduce of
the cotangent backward) after its norm and ends with `tp.forward_site` (g: all-reduce forward,
identity backward), so a layer has 2 forward and 2 backward sites. f sits after the norm, so the
norm's backward sees the full (reduced) cotangent and its weights get identical gradients on
every rank. The Flax layers (`echo_jax.flax.linen.ColumnParallelDense` / `RowParallelDense`)
call the same two `echo_jax.tp` sites; the model keeps its own projections for one f per block
in front of several column projections, taps of the partial sums, and the simulation's rounding
pins below (docs/models.md, "The model's TP sites and the Flax layers";
tests/models/test_model_sites.py checks that both give the same bits).

Compensator states (echo_jax.tp): the forward state is one CompensatorState shaped like a block
output [B, T, D] (in CommConfig.state_dtype: fp32 unless the Echo configs ask for bfloat16), carried through the scan carry and created as zeros at the start of every
forward pass. The backward state is a CompensatorState input of every f site threaded through the
carry in the forward pass (returned unchanged); in the backward pass its cotangent carries the live
state from site to site in backward order. Its initial value is zeros (`init_state`), so the
gradient with respect to it is the final backward state. Exact mode (CommConfig.echo=None) runs
the same code with config None (plain `lax.psum`).

Per-site configs. Every site gets a static tuple of configs and a traced index (a `lax.switch`
in echo_jax.tp): one config everywhere (index unused), early 8-bit (the index from the layer
number), or a `SitePolicy` (CommConfig.site_policy): its int32 [L, 2] forward and backward index
tables enter the scan as xs, so layer l's attention and MLP sites each read their own index. The
index is the same on every rank, so the switch stays a switch under vmap.

Site taps. `forward_with_taps` runs this same forward pass with a tap at every forward (g) site:
the tap sees the rank's contribution, the all-reduced sum, the compensator state around the site
and the residual stream (`SiteValues`), may carry a value from site to site, and its outputs are
sown into the "intermediates" collection (stacked over the layers by the scan). The accuracy
study's error process and `models.calibrate` measure the sites this way, so there is one forward
pass to keep correct. Without a tap nothing is sown and the program is unchanged.

Per-rank program semantics. Every rank runs the whole forward pass and the whole backward pass of
the full loss on its own (as in Megatron): the f/g custom VJPs decide what crosses ranks. So
gradients are taken *inside* the per-rank function (`loss_and_grad_*`, `make_train_step`), the
replicated parameters are per-rank copies that receive identical gradients, and shard_map runs with
`check_vma=False`, i.e. with exactly the semantics of the vmap simulation. Parameters of all P
ranks are stacked on a leading axis [P, ...] (`shard_params`).

Simulation == shard_map bit for bit on CPU. The vmap program is not the shard_map program: its
arrays carry a rank axis (or none, for values every rank shares), and its collectives are
reductions over that axis that XLA may fuse with their neighbours. XLA:CPU's code for an op
depends on such context, so the model pins down the few places where that changes the rounding:
  * the runners compile for CPU with `compiler_options()`: no YNNPACK library fusions (they pick
    the summation order of a reduction by its shape, so [P, B, T, hd] and [B, T, hd] rows differ)
    and no excess precision (XLA would keep some bf16 intermediates in fp32 in one program and
    round them in the other);
  * a few values are materialised (`lax.optimization_barrier`): the output of every g, the
    cotangent leaving every f and the QK-norm scale gradients before their psum (so a simulated
    all-reduce, a reduction under vmap, is never merged into the reductions next to it), and the
    keys / values written to the KV cache;
  * the softmax normalises by multiplying with the reciprocal of the sum, the form XLA's
    simplifier rewrites `x / broadcast(s)` into in some programs and not in others;
  * the exact all-reduce of bf16/fp16 values sums in fp32 in the simulation, as XLA:CPU's
    all-reduce does (it promotes them to fp32 and rounds once).
`tests/models/test_model.py::test_simulation_matches_shard_map` checks the logits, the loss and every
gradient bit for bit (exact and Echo 4-bit, P = 2 and 4; fp32, and bf16 with remat), and the
KV-cache test the decoded logits. Not covered: the optimizer step of `make_train_step` (optax's
bias correction divides by a per-rank scalar, which XLA rewrites differently in the two programs).
On GPU the two paths agree to rounding only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from echo_jax import tp as tp_ops
from echo_jax.compensator import CompensatorState, as_carrier, init_state, moments
from models.config import CommConfig, ModelConfig, check_comm, check_tp

F32 = jnp.float32
INIT_STD = 0.02  # HF initializer_range of Qwen3 and Llama

#: Parameter names of the column-parallel kernels (split along their output axis, -1).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: Parameter names of the row-parallel kernels (split along their input axis, -2).
ROW_PARALLEL = ("o_proj", "down_proj")


# --------------------------------------------------------------------------------------------
# Building blocks (shared by the Flax modules and the plain-jnp reference)


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last axis, in fp32: x / sqrt(mean(x^2) + eps) * scale. Returns fp32."""
    x32 = x.astype(F32)
    y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y * scale.astype(F32)


def rope_tables(positions, head_dim: int, base: float):
    """cos and sin of the rotary angles, HF layout (the half-frequencies repeated twice).

    Args:
      positions: int [T] absolute positions.
      head_dim: rotary width (the full head).
      base: RoPE base theta.

    Returns:
      (cos, sin), fp32 [T, head_dim].
    """
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = positions.astype(F32)[:, None] * jnp.asarray(inv_freq, F32)[None, :]  # [T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)                            # [T, hd]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate x [B, T, N, hd] by the angles (HF "rotate_half": pairs (i, i + hd/2)); fp32 math."""
    x32 = x.astype(F32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[None, :, None, :] + rotated * sin[None, :, None, :]
    return out.astype(x.dtype)


def attention(q, k, v, q_pos, k_pos):
    """Causal grouped-query attention.

    Args:
      q: [B, T, H, hd] queries (H = this rank's query heads).
      k, v: [B, S, KV, hd] keys and values (KV divides H; query head h uses KV head h // (H/KV)).
      q_pos: int [T] positions of the queries; k_pos: int [S] positions of the keys. A key is
        visible to a query when k_pos <= q_pos (this also hides unwritten KV-cache slots).

    Returns:
      [B, T, H * hd] in v's dtype.
    """
    b, t, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, hd)                                   # [B, T, KV, G, hd]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                        preferred_element_type=F32) * np.float32(hd ** -0.5)  # [B, KV, G, T, S]
    visible = k_pos[None, :] <= q_pos[:, None]                              # [T, S]
    scores = jnp.where(visible, scores, jnp.finfo(F32).min)
    # Softmax as exp * (1 / sum): written out so that XLA compiles the same rounding into every
    # program (its simplifier turns `e / broadcast(sum)` into this form only in some).
    e = jnp.exp(scores - lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    probs = (e * (1.0 / jnp.sum(e, axis=-1, keepdims=True))).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)                         # [B, T, KV, G, hd]
    return out.reshape(b, t, h * hd)


def state_norm(state: CompensatorState):
    """sqrt(||m1||^2 + ||m2||^2) of a compensator state (a scalar; an int8 state's values)."""
    m1, m2 = moments(state)
    return jnp.sqrt(jnp.sum(jnp.square(m1)) + jnp.sum(jnp.square(m2)))


# --------------------------------------------------------------------------------------------
# Flax modules: one rank's shard


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def sum_grad_over_ranks(w, axis_name):
    """Identity forward; the backward pass sums the cotangent over the ranks (exact psum).

    For a replicated parameter used on rank-local data (the QK-norm scales act on this rank's
    heads only): each rank's cotangent is a partial gradient, the sum is the full one.
    """
    return w


def _sum_grad_fwd(w, axis_name):
    return w, None


def _sum_grad_bwd(axis_name, _, ct):
    # The barrier keeps the rank's partial sum (a reduction over B, T and its heads) apart from
    # the psum, which under vmap is a reduction too: merged, they would sum in another order.
    return (lax.psum(lax.optimization_barrier(ct), axis_name),)


sum_grad_over_ranks.defvjp(_sum_grad_fwd, _sum_grad_bwd)


@jax.custom_vjp
def materialize_cotangent(x):
    """Identity; the backward pass puts an optimization barrier on the cotangent.

    Sits between an RMSNorm and its f site: the all-reduced cotangent is materialised before the
    norm's backward reduces it (under vmap the all-reduce is a reduction XLA could fuse into it).
    """
    return x


def _materialize_fwd(x):
    return x, None


def _materialize_bwd(_, ct):
    return (lax.optimization_barrier(ct),)


materialize_cotangent.defvjp(_materialize_fwd, _materialize_bwd)


def _sum_exact_in_f32(x, comm: CommConfig) -> bool:
    """Whether an exact (psum) site of the *simulation* sums x in fp32.

    XLA:CPU runs a bf16/fp16 all-reduce in fp32 (one rounding at the end), while the vmap
    simulation's psum is a reduction in x's dtype (one rounding per rank). Summing in fp32 in the
    simulation gives it the all-reduce's rounding. Inside shard_map (the axis is manual) nothing
    changes: the wire stays 16-bit.
    """
    return (comm.exact and _simulated_16bit(x, comm))


def _simulated_16bit(x, comm: CommConfig) -> bool:
    return (jnp.dtype(x.dtype).itemsize < 4
            and comm.axis_name not in jax.sharding.get_abstract_mesh().manual_axes)


def _policy_exact_in_f32(x, comm: CommConfig) -> bool:
    """`_sum_exact_in_f32` for the exact (None) configs of a site policy: those branches sum in
    fp32 inside the switch (`echo_jax.tp`'s exact_in_f32), the Echo branches are unchanged."""
    return (comm.site_policy is not None and None in comm.site_policy.configs
            and _simulated_16bit(x, comm))


def f_site(x, comm: CommConfig, configs, bwd_state, choice):
    """The f site (`echo_jax.tp.backward_site`) of a block: x is the norm's output.

    Returns (x, bwd_state) like backward_site; see `materialize_cotangent`, `_sum_exact_in_f32`.
    """
    x = materialize_cotangent(x)
    if _sum_exact_in_f32(x, comm):
        x32, bwd_state = tp_ops.backward_site(x.astype(F32), comm.axis_name, configs, bwd_state,
                                              choice=choice)
        return x32.astype(x.dtype), bwd_state
    return tp_ops.backward_site(x, comm.axis_name, configs, bwd_state, choice=choice,
                                exact_in_f32=_policy_exact_in_f32(x, comm))


def g_site(part, comm: CommConfig, configs, fwd_state, choice):
    """The g site (`echo_jax.tp.forward_site`) of a block: part is this rank's partial output.

    Returns (y, fwd_state) like forward_site, y behind an optimization barrier (the sum is
    materialised before the residual add and the next norm use it).
    """
    if _sum_exact_in_f32(part, comm):
        y, fwd_state = tp_ops.forward_site(part.astype(F32), comm.axis_name, configs, fwd_state,
                                           choice=choice)
        y = y.astype(part.dtype)
    else:
        y, fwd_state = tp_ops.forward_site(part, comm.axis_name, configs, fwd_state,
                                           choice=choice,
                                           exact_in_f32=_policy_exact_in_f32(part, comm))
    return lax.optimization_barrier(y), fwd_state


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (ones at init); output in `dtype`.

    `grad_sum_axis`: sum the scale's gradient over this axis (see `sum_grad_over_ranks`).
    """

    eps: float
    dtype: Any = F32
    param_dtype: Any = F32
    grad_sum_axis: Optional[str] = None

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        if self.grad_sum_axis is not None:
            scale = sum_grad_over_ranks(scale, self.grad_sum_axis)
        return rms_norm(x, scale, self.eps).astype(self.dtype)


def _dense(features: int, name: str, cfg: ModelConfig):
    return nn.Dense(features, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                    param_dtype=jnp.dtype(cfg.param_dtype),
                    kernel_init=nn.initializers.normal(INIT_STD), name=name)


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, for one rank (its local KV heads).

    k, v: [L, B, S, KV/P, hd] in the compute dtype (S = capacity); length: int32 [] tokens
    written (the next token goes to slot `length`). The runners stack it on a leading rank axis.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array


class Attention(nn.Module):
    """Column-parallel Q/K/V (this rank's heads) and row-parallel O; returns a partial sum."""

    cfg: ModelConfig
    comm: CommConfig

    @nn.compact
    def __call__(self, x, positions, rope, cache):
        cfg, p = self.cfg, self.comm.tp
        b, t, _ = x.shape                                       # x: [B, T, D] replicated
        heads, kv_heads, hd = cfg.n_heads // p, cfg.n_kv_heads // p, cfg.head_dim
        q = _dense(heads * hd, "q_proj", cfg)(x).reshape(b, t, heads, hd)      # [B, T, H/P, hd]
        k = _dense(kv_heads * hd, "k_proj", cfg)(x).reshape(b, t, kv_heads, hd)  # [B,T,KV/P,hd]
        v = _dense(kv_heads * hd, "v_proj", cfg)(x).reshape(b, t, kv_heads, hd)
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim, one scale shared by all heads
            dt, pdt, axis = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype), self.comm.axis_name
            # The scale sees only this rank's heads: its gradient is summed over the ranks.
            q = RMSNorm(cfg.norm_eps, dt, pdt, axis, name="q_norm")(q)
            k = RMSNorm(cfg.norm_eps, dt, pdt, axis, name="k_norm")(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            k_all, v_all, k_pos = k, v, positions               # [B, T, KV/P, hd]
        else:  # write this step's keys at slots positions[0] .. positions[0] + T - 1
            k_cache, v_cache = cache                            # [B, S, KV/P, hd]
            start = positions[0]
            # Materialised before the write: under vmap the per-rank slot index makes the write a
            # scatter, and XLA:CPU rounds the QK-norm / RoPE fused into it differently.
            k, v = lax.optimization_barrier((k, v))
            k_all = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
            v_all = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
            k_pos = jnp.arange(k_cache.shape[1], dtype=positions.dtype)
            cache = (k_all, v_all)
        out = attention(q, k_all, v_all, positions, k_pos)     # [B, T, H/P * hd]
        return _dense(cfg.dim, "o_proj", cfg)(out), cache       # [B, T, D] partial over ranks


class MLP(nn.Module):
    """SwiGLU: column-parallel gate/up (ffn_dim/P columns), row-parallel down; a partial sum."""

    cfg: ModelConfig
    comm: CommConfig

    @nn.compact
    def __call__(self, x):                                      # x: [B, T, D] replicated
        f = self.cfg.ffn_dim // self.comm.tp
        gate = _dense(f, "gate_proj", self.cfg)(x)              # [B, T, F/P]
        up = _dense(f, "up_proj", self.cfg)(x)                  # [B, T, F/P]
        return _dense(self.cfg.dim, "down_proj", self.cfg)(nn.silu(gate) * up)  # [B, T, D]


class SiteValues(NamedTuple):
    """What a site tap sees at one forward (g) site of one rank; see `forward_with_taps`.

    part: this rank's block output x_k,i [B, T, D] (compute dtype); y: the all-reduced sum y_k
    [B, T, D]; state_in / state_out: the forward CompensatorState entering and leaving the site;
    hidden: the residual stream after the site, h + y_k [B, T, D].
    """

    part: jax.Array
    y: jax.Array
    state_in: CompensatorState
    state_out: CompensatorState
    hidden: jax.Array


class DecoderLayer(nn.Module):
    """One layer as the body of `nn.scan`: carry (h, fwd_state, bwd_state, tap_carry), xs (layer,
    choices, cache, tap_xs).

    The layer index selects per-layer bits (CommConfig.early_8bit); with a site policy, choices
    is the layer's row of the policy's index tables, (forward [2], backward [2]): indices into
    the config tuples of its attention and MLP sites. With `return_state_norms` the per-layer
    output is the norm of the forward state entering the layer, after its attention site and
    after its MLP site ([3]). With a `site_tap`, each forward site calls
    ``site_tap(SiteValues, tap_carry, tap_xs[i]) -> (tap_carry, out)`` (i = 0 attention, 1 MLP)
    and the layer sows the two outputs, stacked [2, ...], as "intermediates" / "site_taps".
    """

    cfg: ModelConfig
    comm: CommConfig
    return_state_norms: bool = False
    site_tap: Optional[Callable] = None

    def _tap(self, tap_carry, tap_xs, index: int, part, y, state_in, state_out, hidden):
        """Call the site tap (if any) at one site; returns (tap_carry, its output or None)."""
        if self.site_tap is None:
            return tap_carry, None
        xs = None if tap_xs is None else jax.tree.map(lambda a: a[index], tap_xs)
        return self.site_tap(SiteValues(part, y, state_in, state_out, hidden), tap_carry, xs)

    @nn.compact
    def __call__(self, carry, xs, positions, rope):
        cfg, comm = self.cfg, self.comm
        h, fwd, bwd, tap_carry = carry  # h: [B, T, D]; fwd, bwd: CompensatorState of [B, T, D]
        layer, choices, cache, tap_xs = xs  # layer: int32 []; cache: ([B, S, KV/P, hd],) * 2
        fcfg, bcfg = comm.forward_configs(), comm.backward_configs()
        if choices is None:            # one config, or per layer (early 8-bit)
            choice = comm.layer_choice(layer, cfg.n_layers)
            g_attn = g_mlp = f_attn = f_mlp = choice
        else:                          # per site: int32 [2] forward, [2] backward
            fwd_row, bwd_row = choices
            g_attn, g_mlp, f_attn, f_mlp = fwd_row[0], fwd_row[1], bwd_row[0], bwd_row[1]
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        norms = [state_norm(fwd)] if self.return_state_norms else None

        # Attention block: norm -> f -> column/row-parallel attention -> g -> residual.
        x = RMSNorm(cfg.norm_eps, dt, pdt, name="attn_norm")(h)              # [B, T, D]
        x, bwd = f_site(x, comm, bcfg, bwd, f_attn)                           # f
        part, cache = Attention(cfg, comm, name="attn")(x, positions, rope, cache)
        y, fwd_out = g_site(part, comm, fcfg, fwd, g_attn)                    # g: [B, T, D]
        h = h + y
        tap_carry, tap_attn = self._tap(tap_carry, tap_xs, 0, part, y, fwd, fwd_out, h)
        fwd = fwd_out
        if norms is not None:
            norms.append(state_norm(fwd))

        # MLP block: the same pattern.
        x = RMSNorm(cfg.norm_eps, dt, pdt, name="mlp_norm")(h)
        x, bwd = f_site(x, comm, bcfg, bwd, f_mlp)                            # f
        part = MLP(cfg, comm, name="mlp")(x)
        y, fwd_out = g_site(part, comm, fcfg, fwd, g_mlp)                     # g
        h = h + y
        tap_carry, tap_mlp = self._tap(tap_carry, tap_xs, 1, part, y, fwd, fwd_out, h)
        fwd = fwd_out
        if norms is not None:
            norms.append(state_norm(fwd))
            norms = jnp.stack(norms)                                          # [3]
        if self.site_tap is not None:
            self.sow("intermediates", "site_taps",
                     jax.tree.map(lambda a, b: jnp.stack([a, b]), tap_attn, tap_mlp))
        return (h, fwd, bwd, tap_carry), (norms, cache)


class Transformer(nn.Module):
    """The decoder for one rank: embedding, L scanned layers, final norm, LM head.

    Call with tokens [B, T], positions int32 [T], the initial backward state (zeros
    CompensatorState of [B, T, D]), an optional per-layer cache ((k, v) of [L, B, S, KV/P, hd])
    and optional site choices (forward, backward) int32 [L, 2] that replace the tables of
    comm.site_policy (its configs stay; e.g. calibration runs many tables through one program).
    Returns (logits fp32 [B, T, V], new cache or None, state norms [L, 3] or None).

    With a `site_tap` (see `DecoderLayer`), tap_carry is the tap's initial carry and tap_xs its
    per-site inputs [L, 2, ...]; the taps' outputs are sown into "intermediates" (stacked
    [L, 2, ...] under "layers" / "site_taps") with the residual stream before the final norm
    ("residual"); `forward_with_taps` reads them.
    """

    cfg: ModelConfig
    comm: CommConfig
    return_state_norms: bool = False
    remat: bool = False
    site_tap: Optional[Callable] = None

    @nn.compact
    def __call__(self, tokens, positions, bwd_state, cache=None, site_choices=None,
                 tap_carry=None, tap_xs=None):
        cfg = self.cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.dim, dtype=dt, param_dtype=pdt,
                         embedding_init=nn.initializers.normal(INIT_STD), name="embed")
        h = embed(tokens)                                       # [B, T, D], replicated
        fwd = init_state(h, dtype=self.comm.state_dtype)        # zeros at the start of the pass
        rope = rope_tables(positions, cfg.head_dim, cfg.rope_base)  # ([T, hd], [T, hd])

        layer_cls = nn.remat(DecoderLayer, prevent_cse=False) if self.remat else DecoderLayer
        stack = nn.scan(layer_cls, variable_axes={"params": 0, "intermediates": 0},
                        split_rngs={"params": True}, in_axes=(0, nn.broadcast, nn.broadcast),
                        length=cfg.n_layers)
        layers = jnp.arange(cfg.n_layers, dtype=jnp.int32)      # [L]: per-layer bits choice
        if site_choices is None:
            site_choices = self.comm.site_tables(cfg.n_layers)   # per-site choice, or None
        elif self.comm.site_policy is None:
            raise ValueError("site_choices index the configs of CommConfig.site_policy, which "
                             "is None")
        if site_choices is not None:
            site_choices = tuple(jnp.asarray(t, jnp.int32) for t in site_choices)
            for t in site_choices:
                if t.shape != (cfg.n_layers, 2):
                    raise ValueError(f"site choice tables must be int [L, 2] = "
                                     f"[{cfg.n_layers}, 2], got {t.shape}")
        (h, _, _, _), (norms, cache) = stack(cfg, self.comm, self.return_state_norms,
                                             self.site_tap, name="layers")(
            (h, fwd, bwd_state, tap_carry), (layers, site_choices, cache, tap_xs), positions, rope)
        if self.site_tap is not None:
            self.sow("intermediates", "residual", h)

        h = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(h)  # [B, T, D]
        if cfg.tie_embeddings:
            w = embed.embedding.astype(dt)                      # [V, D]
            logits = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=F32)
        else:
            w = self.param("lm_head", nn.initializers.normal(INIT_STD),
                           (cfg.dim, cfg.vocab_size), pdt).astype(dt)  # [D, V]
            logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=F32)
        return logits, cache, norms                             # logits: [B, T, V] fp32


# --------------------------------------------------------------------------------------------
# Parameters: shapes, init, shard / unshard


def param_shapes(cfg: ModelConfig, tp: int = 1) -> dict:
    """Shapes of one rank's parameters (tp=1: the full model), as a nested dict of tuples.

    Layer parameters carry a leading layer axis L (the `nn.scan` layout). Kernels are stored
    [in, out] (HF's torch weights transposed).
    """
    check_tp(cfg, tp)
    d, l, hd = cfg.dim, cfg.n_layers, cfg.head_dim
    q, kv, f = cfg.q_dim // tp, cfg.kv_dim // tp, cfg.ffn_dim // tp
    attn = {"q_proj": {"kernel": (l, d, q)}, "k_proj": {"kernel": (l, d, kv)},
            "v_proj": {"kernel": (l, d, kv)}, "o_proj": {"kernel": (l, q, d)}}
    if cfg.qk_norm:
        attn["q_norm"] = {"scale": (l, hd)}
        attn["k_norm"] = {"scale": (l, hd)}
    shapes = {
        "embed": {"embedding": (cfg.vocab_size, d)},
        "layers": {
            "attn_norm": {"scale": (l, d)},
            "attn": attn,
            "mlp_norm": {"scale": (l, d)},
            "mlp": {"gate_proj": {"kernel": (l, d, f)}, "up_proj": {"kernel": (l, d, f)},
                    "down_proj": {"kernel": (l, f, d)}},
        },
        "final_norm": {"scale": (d,)},
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def shard_axis(path) -> Optional[int]:
    """Axis along which a parameter (given by its pytree path) is split over ranks, or None.

    Column-parallel kernels split their output axis (-1), row-parallel ones their input axis (-2);
    everything else is replicated.
    """
    names = _names(path)
    if len(names) >= 2 and names[-1] == "kernel":
        if names[-2] in COLUMN_PARALLEL:
            return -1
        if names[-2] in ROW_PARALLEL:
            return -2
    return None


def init_params(key, cfg: ModelConfig) -> dict:
    """Random full (unsharded) parameters: kernels and embeddings N(0, 0.02^2), norm scales 1.

    Args:
      key: a jax.random key.
      cfg: the model config.

    Returns:
      Nested dict of arrays in cfg.param_dtype, shaped as `param_shapes(cfg)`.
    """
    pdt = jnp.dtype(cfg.param_dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, shape) in zip(keys, leaves):
        if _names(path)[-1] == "scale":
            out.append(jnp.ones(shape, pdt))
        else:
            out.append((INIT_STD * jax.random.normal(k, shape, F32)).astype(pdt))
    return jax.tree_util.tree_unflatten(treedef, out)


def shard_params(full: dict, tp: int, cfg: Optional[ModelConfig] = None) -> dict:
    """Split full parameters into per-rank shards stacked on a leading axis [P, ...].

    Rank r gets the r-th contiguous chunk of every column-/row-parallel kernel (whole heads when
    P divides n_heads and n_kv_heads) and a copy of every other parameter. numpy inputs stay
    numpy (host), jax inputs give jax arrays.

    Args:
      full: parameters shaped as `param_shapes(cfg)`.
      tp: the number of ranks P.
      cfg: if given, checked with `check_tp` first (recommended: a split that cuts heads is
        otherwise not detected).

    Returns:
      The stacked per-rank parameters; `unshard_params` inverts it exactly.
    """
    if cfg is not None:
        check_tp(cfg, tp)
    elif isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"shard_params: tp must be a positive int, got {tp!r}")

    def one(path, leaf):
        xp = np if isinstance(leaf, np.ndarray) else jnp
        axis = shard_axis(path)
        if axis is None:
            return xp.stack([leaf] * tp)
        if leaf.shape[axis] % tp:
            raise ValueError(f"shard_params: {'/'.join(_names(path))} has {leaf.shape[axis]} "
                             f"columns on its split axis, not divisible by P={tp}")
        return xp.stack(xp.split(leaf, tp, axis=axis))

    return jax.tree_util.tree_map_with_path(one, full)


def unshard_params(stacked: dict) -> dict:
    """The inverse of `shard_params`: concatenate the shards, take rank 0's copy of the rest.

    Also turns per-rank gradients (from `loss_and_grad_*`) into gradients of the full model.
    """
    def one(path, leaf):
        xp = np if isinstance(leaf, np.ndarray) else jnp
        axis = shard_axis(path)
        if axis is None:
            return leaf[0]
        return xp.concatenate([leaf[r] for r in range(leaf.shape[0])], axis=axis)

    return jax.tree_util.tree_map_with_path(one, stacked)


def check_params(params, cfg: ModelConfig, tp: int, stacked: bool = True) -> None:
    """Raise a ValueError naming the first parameter whose shape does not fit (cfg, P)."""
    expect = param_shapes(cfg, tp)
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(
        expect, is_leaf=lambda x: isinstance(x, tuple))
    try:
        got = exp_def.flatten_up_to(params)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"parameters do not match the structure of {cfg.name!r} "
                         f"(see models.model.param_shapes): {err}") from None
    for (path, shape), leaf in zip(exp_leaves, got):
        want = ((tp,) + shape) if stacked else shape
        if tuple(jnp.shape(leaf)) != want:
            raise ValueError(
                f"parameter {'/'.join(_names(path))} has shape {tuple(jnp.shape(leaf))}, "
                f"expected {want} for {cfg.name!r} at P={tp}"
                + (" (per-rank params stacked on a leading axis: use shard_params)"
                   if stacked else ""))


def place_params(params_stacked, mesh: Mesh, comm: CommConfig):
    """Put stacked per-rank arrays (params, optimizer state, caches) on the mesh, rank r's slice
    on the device at position r of the "tp" axis."""
    sharding = NamedSharding(mesh, PS(comm.axis_name))
    return jax.tree.map(lambda a: jax.device_put(a, sharding), params_stacked)


# --------------------------------------------------------------------------------------------
# The per-rank forward pass


class ForwardOutput(NamedTuple):
    """Output of `forward_local`: logits fp32 [B, T, V]; the updated KVCache (or None); the
    forward-state norms [L, 3] (entering each layer, after its attention g, after its MLP g),
    or None."""

    logits: jax.Array
    cache: Optional[KVCache]
    state_norms: Optional[jax.Array]


def forward_local(params, tokens, model_cfg: ModelConfig, comm: CommConfig, *,
                  cache: Optional[KVCache] = None, bwd_state: Optional[CompensatorState] = None,
                  return_state_norms: bool = False, remat: bool = False,
                  site_choices=None) -> ForwardOutput:
    """One rank's forward pass; call inside `jax.shard_map` / `jax.vmap` binding comm.axis_name.

    Args:
      params: this rank's parameters (`param_shapes(model_cfg, comm.tp)`).
      tokens: int [B, T] token ids.
      model_cfg, comm: the configs.
      cache: a KVCache of this rank: the tokens go to positions cache.length ... + T - 1 and
        attend to the cached ones; None: positions 0 ... T - 1, no cache.
      bwd_state: the initial backward compensator state (zeros CompensatorState of [B, T, D]
        in comm.state_dtype); None creates it. Pass it explicitly to read the final backward
        state as its gradient (an int8 state: in the form `compensator.as_carrier` gives it,
        whose codes have a float dtype; the codes of an int8 array get no gradient).
      return_state_norms: also return the per-layer forward-state norms.
      remat: rematerialise each layer in the backward pass (saves activation memory).
      site_choices: (forward, backward) int [L, 2] index tables into comm.site_policy's configs
        that replace the policy's own (may be traced: one compiled program serves many tables).

    Returns:
      ForwardOutput(logits [B, T, V] fp32, new cache or None, state norms [L, 3] or None).
    """
    b, t = tokens.shape
    start = jnp.int32(0) if cache is None else cache.length
    positions = start + jnp.arange(t, dtype=jnp.int32)                     # [T]
    if bwd_state is None:
        bwd_state = init_state(jax.ShapeDtypeStruct((b, t, model_cfg.dim), F32),
                               dtype=comm.state_dtype)
    bwd_state = as_carrier(bwd_state)  # an int8 state's codes as the f sites pass them on
    layer_cache = None if cache is None else (cache.k, cache.v)
    module = Transformer(model_cfg, comm, return_state_norms, remat)
    logits, new_cache, norms = module.apply({"params": params}, tokens, positions, bwd_state,
                                            layer_cache, site_choices)
    if cache is not None:
        new_cache = KVCache(new_cache[0], new_cache[1], cache.length + t)
    return ForwardOutput(logits, new_cache, norms)


class TappedForward(NamedTuple):
    """Output of `forward_with_taps`: logits fp32 [B, T, V]; the residual stream before the
    final norm [B, T, D] (compute dtype); the tap's outputs stacked over the 2 L forward sites
    [2 L, ...] (site 2l is layer l's attention output, 2l + 1 its MLP output)."""

    logits: jax.Array
    residual: jax.Array
    taps: Any


def forward_with_taps(params, tokens, model_cfg: ModelConfig, comm: CommConfig,
                      tap: Callable, *, tap_carry=None, tap_xs=None) -> TappedForward:
    """One rank's forward pass (`forward_local`, no cache) with a tap at every forward site.

    The tap reads the values of the model's own pass (the one forward pass: no second copy of
    the model to keep in step); call inside `jax.shard_map` / `jax.vmap` binding comm.axis_name,
    like `forward_local`. The tap may use comm.axis_name collectives (e.g. the exact fp32 sum
    of the contributions).

    Args:
      params: this rank's parameters.
      tokens: int [B, T] token ids (positions 0 ... T - 1).
      model_cfg, comm: the configs.
      tap: ``tap(SiteValues, carry, xs) -> (carry, out)``, called at the 2 L forward sites in
        order; `out` is a pytree of arrays of the same shapes at every site.
      tap_carry: the carry of the first call (a pytree, e.g. an accumulated error), or None.
      tap_xs: per-site inputs, a pytree of arrays [2 L, ...] (site k's slice goes to its
        call), or None.

    Returns:
      TappedForward(logits, residual, taps [2 L, ...]).
    """
    b, t = tokens.shape
    n_layers = model_cfg.n_layers
    positions = jnp.arange(t, dtype=jnp.int32)
    bwd_state = as_carrier(init_state(jax.ShapeDtypeStruct((b, t, model_cfg.dim), F32),
                                      dtype=comm.state_dtype))
    if tap_xs is not None:  # [2 L, ...] -> [L, 2, ...]: the scan hands each layer its two rows
        tap_xs = jax.tree.map(lambda a: a.reshape((n_layers, 2) + a.shape[1:]), tap_xs)
    module = Transformer(model_cfg, comm, site_tap=tap)
    (logits, _, _), sown = module.apply({"params": params}, tokens, positions, bwd_state, None,
                                        None, tap_carry, tap_xs, mutable=["intermediates"])
    inter = sown["intermediates"]
    taps = jax.tree.map(lambda a: a.reshape((2 * n_layers,) + a.shape[2:]),
                        inter["layers"]["site_taps"][0])
    return TappedForward(logits, inter["residual"][0], taps)


def cross_entropy(logits, targets, mask=None):
    """Mean token-level cross-entropy (nats).

    Args:
      logits: [B, T, V] (any float dtype; computed in fp32).
      targets: int [B, T] target ids.
      mask: optional [B, T] weights (1 = count the token).

    Returns:
      fp32 scalar: sum(mask * nll) / max(sum(mask), 1).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {logits.shape} and targets {targets.shape} "
                         "disagree on [B, T]")
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(F32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_local(params, tokens, targets, model_cfg: ModelConfig, comm: CommConfig, mask=None,
               *, bwd_state=None, remat: bool = False):
    """One rank's loss (the full model's loss; every rank computes it). See `forward_local`."""
    out = forward_local(params, tokens, model_cfg, comm, bwd_state=bwd_state, remat=remat)
    return cross_entropy(out.logits, targets, mask)


# --------------------------------------------------------------------------------------------
# Runners: shard_map over the mesh's "tp" axis, or vmap simulation of P ranks on one device


def run_per_rank(fn: Callable, comm: CommConfig, mesh: Optional[Mesh] = None, *,
                 stacked_in: tuple, stacked_out) -> Callable:
    """Run a per-rank function on all P ranks, as shard_map (mesh given) or vmap (mesh None).

    Args:
      fn: per-rank function of positional args; it may use comm.axis_name collectives.
      comm: gives P and the axis name.
      mesh: a Mesh with an axis comm.axis_name of size P (other axes replicate); None simulates
        the P ranks with `jax.vmap(..., axis_name=comm.axis_name)` on one device.
      stacked_in: one bool per positional arg: True = a pytree stacked per rank [P, ...],
        False = the same value on every rank.
      stacked_out: a pytree prefix of fn's output with bools: True = return it stacked [P, ...],
        False = it is the same on every rank, return one copy (rank 0's).

    Returns:
      A function of the same positional args (not jitted).
    """
    axis = comm.axis_name
    out_is_leaf = lambda x: isinstance(x, bool)  # noqa: E731
    if mesh is not None:
        if axis not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}, no {axis!r} "
                             "(CommConfig.axis_name)")
        if mesh.shape[axis] != comm.tp:
            raise ValueError(f"mesh axis {axis!r} has size {mesh.shape[axis]} but "
                             f"CommConfig.tp={comm.tp}")

        def body(*args):
            args = [jax.tree.map(lambda a: a[0], a) if s else a
                    for a, s in zip(args, stacked_in)]
            out = fn(*args)
            return jax.tree.map(lambda s, o: jax.tree.map(lambda a: a[None], o) if s else o,
                                stacked_out, out, is_leaf=out_is_leaf)

        in_specs = tuple(PS(axis) if s else PS() for s in stacked_in)
        out_specs = jax.tree.map(lambda s: PS(axis) if s else PS(), stacked_out,
                                 is_leaf=out_is_leaf)
        # check_vma=False: per-rank program semantics, the same as the vmap simulation.
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    mapped = jax.vmap(fn, in_axes=tuple(0 if s else None for s in stacked_in),
                      axis_name=axis, axis_size=comm.tp)

    def simulated(*args):
        out = mapped(*args)
        return jax.tree.map(lambda s, o: o if s else jax.tree.map(lambda a: a[0], o),
                            stacked_out, out, is_leaf=out_is_leaf)

    return simulated


def _check_tokens(tokens, cfg: ModelConfig, start: int = 0, name: str = "tokens"):
    shape = jnp.shape(tokens)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name} must be int [B, T] with B, T >= 1, got shape {shape}")
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"{name} must be integer token ids, got {jnp.result_type(tokens)}")
    if start + shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence of {start + shape[1]} positions (start {start} + {shape[1]} "
                         f"tokens) exceeds ModelConfig.max_seq_len={cfg.max_seq_len}")
    if not isinstance(tokens, jax.core.Tracer):
        arr = np.asarray(tokens)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"{name} ids must be in [0, {cfg.vocab_size}), "
                             f"got values in [{lo}, {hi}]")


def _check_call(params, model_cfg: ModelConfig, comm: CommConfig):
    if not isinstance(model_cfg, ModelConfig):
        raise ValueError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    if not isinstance(comm, CommConfig):
        raise ValueError(f"comm must be a CommConfig, got {type(comm).__name__}")
    check_comm(model_cfg, comm)
    check_params(params, model_cfg, comm.tp, stacked=True)


#: XLA:CPU options of the runners (see the module docstring): no YNNPACK fusions (their reduction
#: order depends on the shape) and no excess precision (bf16 intermediates rounded everywhere).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "",
                        "xla_allow_excess_precision": False}


@functools.lru_cache(maxsize=None)
def _cpu_options_supported() -> bool:
    try:  # an XLA that does not know an option refuses to compile with it
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(
            jax.ShapeDtypeStruct((), F32)).compile()
        return True
    except Exception:  # noqa: BLE001 - any refusal: compile without them
        return False


def compiler_options(mesh: Optional[Mesh] = None) -> Optional[dict]:
    """`jax.jit` compiler options under which the vmap simulation and shard_map give the same bits.

    Args:
      mesh: the shard_map mesh, or None for the simulation (on the default backend).

    Returns:
      `CPU_COMPILER_OPTIONS` when compiling for CPU (and this XLA knows them), else None.
    """
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform != "cpu" or not _cpu_options_supported():
        return None
    return dict(CPU_COMPILER_OPTIONS)


def jit_per_rank(fn: Callable, comm: CommConfig, mesh: Optional[Mesh] = None, *,
                 stacked_in: tuple, stacked_out, **jit_kwargs) -> Callable:
    """`jax.jit(run_per_rank(...))` with `compiler_options(mesh)`; arguments as `run_per_rank`."""
    return jax.jit(run_per_rank(fn, comm, mesh, stacked_in=stacked_in, stacked_out=stacked_out),
                   compiler_options=compiler_options(mesh), **jit_kwargs)


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, model_cfg: ModelConfig, comm: CommConfig, mesh: Optional[Mesh],
              opts: tuple = ()):
    """A jitted runner of `kind` for these (hashable) configs; cached."""
    o = dict(opts)
    if kind == "apply":
        norms = o.get("return_state_norms", False)

        def fn(params, tokens):
            out = forward_local(params, tokens, model_cfg, comm, return_state_norms=norms)
            return out.logits, out.state_norms
        return jit_per_rank(fn, comm, mesh, stacked_in=(True, False), stacked_out=(False, True))
    if kind == "loss_and_grad":
        def fn(params, tokens, targets, mask):
            return jax.value_and_grad(loss_local)(params, tokens, targets, model_cfg, comm,
                                                  mask, remat=o.get("remat", False))
        return jit_per_rank(fn, comm, mesh, stacked_in=(True, False, False, False),
                            stacked_out=(False, True))
    if kind == "extend":
        def fn(params, tokens, cache):
            out = forward_local(params, tokens, model_cfg, comm, cache=cache)
            return out.logits, out.cache
        return jit_per_rank(fn, comm, mesh, stacked_in=(True, False, True),
                            stacked_out=(False, True))
    raise ValueError(kind)


def apply_sharded(params_stacked, tokens, model_cfg: ModelConfig, comm: CommConfig, mesh: Mesh,
                  *, return_state_norms: bool = False):
    """Logits of the TP model with shard_map over the mesh axis comm.axis_name (size P).

    Args:
      params_stacked: per-rank parameters stacked [P, ...] (`shard_params`).
      tokens: int [B, T] (replicated on every rank).
      model_cfg, comm: the configs.
      mesh: a Mesh with an axis comm.axis_name of size comm.tp.
      return_state_norms: also return the forward-state norms, [P, L, 3].

    Returns:
      logits fp32 [B, T, V] (or (logits, state_norms)).
    """
    return _apply(params_stacked, tokens, model_cfg, comm, mesh, return_state_norms)


def apply_simulated(params_stacked, tokens, model_cfg: ModelConfig, comm: CommConfig, *,
                    return_state_norms: bool = False):
    """Logits of the TP model with P ranks simulated by vmap on one device; see apply_sharded."""
    return _apply(params_stacked, tokens, model_cfg, comm, None, return_state_norms)


def _apply(params, tokens, model_cfg, comm, mesh, return_state_norms):
    _check_call(params, model_cfg, comm)
    _check_tokens(tokens, model_cfg)
    f = _compiled("apply", model_cfg, comm, mesh,
                  (("return_state_norms", bool(return_state_norms)),))
    logits, norms = f(params, tokens)
    return (logits, norms) if return_state_norms else logits


def loss_and_grad_sharded(params_stacked, tokens, targets, model_cfg: ModelConfig,
                          comm: CommConfig, mesh: Mesh, mask=None, *, remat: bool = False):
    """Loss and per-rank gradients with shard_map (each rank differentiates its own copy).

    Args:
      params_stacked: per-rank parameters [P, ...].
      tokens, targets: int [B, T]; mask: optional [B, T] weights.
      model_cfg, comm, mesh: as `apply_sharded`.
      remat: rematerialise layers in the backward pass.

    Returns:
      (loss fp32 scalar, grads stacked [P, ...] like params_stacked). `unshard_params(grads)` is
      the gradient of the full model; the replicated parameters' copies get identical gradients.
    """
    return _loss_and_grad(params_stacked, tokens, targets, model_cfg, comm, mesh, mask, remat)


def loss_and_grad_simulated(params_stacked, tokens, targets, model_cfg: ModelConfig,
                            comm: CommConfig, mask=None, *, remat: bool = False):
    """`loss_and_grad_sharded` with the P ranks simulated by vmap on one device."""
    return _loss_and_grad(params_stacked, tokens, targets, model_cfg, comm, None, mask, remat)


def _loss_and_grad(params, tokens, targets, model_cfg, comm, mesh, mask, remat):
    _check_call(params, model_cfg, comm)
    _check_tokens(tokens, model_cfg)
    _check_tokens(targets, model_cfg, name="targets")
    if jnp.shape(targets) != jnp.shape(tokens):
        raise ValueError(f"targets {jnp.shape(targets)} must be shaped like tokens "
                         f"{jnp.shape(tokens)}")
    f = _compiled("loss_and_grad", model_cfg, comm, mesh, (("remat", bool(remat)),))
    return f(params, tokens, targets, mask)


# --------------------------------------------------------------------------------------------
# Training


def tp_global_norm(grads_local, comm: CommConfig):
    """Global L2 norm of the full model's gradient, from one rank's gradients (inside a runner).

    Sharded parameters contribute the psum of their shards' squares, replicated ones once.
    """
    sq = {"sharded": jnp.float32(0), "replicated": jnp.float32(0)}

    def add(path, g):
        key = "replicated" if shard_axis(path) is None else "sharded"
        sq[key] = sq[key] + jnp.sum(jnp.square(g.astype(F32)))

    jax.tree_util.tree_map_with_path(add, grads_local)
    return jnp.sqrt(lax.psum(sq["sharded"], comm.axis_name) + sq["replicated"])


def init_opt_state(optimizer, params_stacked):
    """Per-rank optimizer states stacked [P, ...] (`optimizer` is an optax transformation)."""
    return jax.vmap(optimizer.init)(params_stacked)


def make_train_step(model_cfg: ModelConfig, comm: CommConfig, optimizer,
                    mesh: Optional[Mesh] = None, *, clip_norm: Optional[float] = None,
                    remat: bool = False):
    """A jitted training step; every rank updates its own shard (and its replicated copies).

    The optimizer runs per rank on per-rank gradients, so it must be element-wise (adamw, sgd,
    ...): a transformation that reduces over parameters (e.g. optax.clip_by_global_norm) would
    see only the local shard. Use `clip_norm` here for global-norm clipping: the norm is the
    full model's (`tp_global_norm`), identical on every rank.

    Args:
      model_cfg, comm: the configs.
      optimizer: an optax GradientTransformation.
      mesh: shard_map over this mesh; None simulates the ranks with vmap.
      clip_norm: clip the gradient to this global L2 norm (None: no clipping).
      remat: rematerialise layers in the backward pass.

    Returns:
      step(params, opt_state, tokens, targets, mask=None) -> (params, opt_state, loss,
      grad_norm), with params / opt_state stacked [P, ...] (`init_opt_state`).
    """
    import optax

    check_comm(model_cfg, comm)

    def local_step(params, opt_state, tokens, targets, mask):
        loss, grads = jax.value_and_grad(loss_local)(params, tokens, targets, model_cfg, comm,
                                                     mask, remat=remat)
        gnorm = tp_global_norm(grads, comm)
        if clip_norm is not None:
            factor = jnp.minimum(1.0, clip_norm / jnp.maximum(gnorm, 1e-12))
            grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, gnorm

    run = jit_per_rank(local_step, comm, mesh, stacked_in=(True, True, False, False, False),
                       stacked_out=(True, True, False, False))

    def step(params, opt_state, tokens, targets, mask=None):
        _check_tokens(tokens, model_cfg)
        _check_tokens(targets, model_cfg, name="targets")
        return run(params, opt_state, tokens, targets, mask)

    return step


# --------------------------------------------------------------------------------------------
# KV-cache decoding (prefill, then one token per step)


def init_cache(model_cfg: ModelConfig, comm: CommConfig, batch_size: int,
               max_len: int) -> KVCache:
    """An empty KV cache for all ranks, stacked [P, ...] (each rank caches its local KV heads).

    Args:
      model_cfg, comm: the configs.
      batch_size: B.
      max_len: capacity S in tokens (prompt + generated), at most model_cfg.max_seq_len.

    Returns:
      KVCache(k, v [P, L, B, S, KV/P, hd] zeros in the compute dtype, length [P] zeros).
    """
    check_comm(model_cfg, comm)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
        raise ValueError(f"init_cache: max_len must be a positive int, got {max_len!r}")
    if max_len > model_cfg.max_seq_len:
        raise ValueError(f"init_cache: max_len={max_len} exceeds ModelConfig.max_seq_len="
                         f"{model_cfg.max_seq_len}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"init_cache: batch_size must be a positive int, got {batch_size!r}")
    p = comm.tp
    shape = (p, model_cfg.n_layers, batch_size, max_len, model_cfg.n_kv_heads // p,
             model_cfg.head_dim)
    z = jnp.zeros(shape, jnp.dtype(model_cfg.dtype))
    return KVCache(z, z, jnp.zeros((p,), jnp.int32))


def prefill(params_stacked, tokens, cache: KVCache, model_cfg: ModelConfig, comm: CommConfig,
            mesh: Optional[Mesh] = None):
    """Run tokens [B, T] through the model, appending their keys/values to the cache.

    Args:
      params_stacked: per-rank parameters [P, ...].
      tokens: int [B, T] (the prompt; or any continuation of what the cache holds).
      cache: stacked KVCache from `init_cache` (or a previous call).
      model_cfg, comm: the configs.
      mesh: shard_map over this mesh; None simulates the ranks with vmap.

    Returns:
      (logits fp32 [B, T, V], updated cache).
    """
    _check_call(params_stacked, model_cfg, comm)
    if not isinstance(cache, KVCache):
        raise ValueError("cache must be a KVCache from init_cache")
    start = 0
    if not isinstance(cache.length, jax.core.Tracer):
        start = int(np.asarray(cache.length).reshape(-1)[0])
    _check_tokens(tokens, model_cfg, start)
    capacity = cache.k.shape[3]
    if start + tokens.shape[1] > capacity:
        raise ValueError(f"KV cache full: {start} cached + {tokens.shape[1]} new tokens exceed "
                         f"its capacity {capacity} (init_cache max_len)")
    if cache.k.shape[2] != tokens.shape[0]:
        raise ValueError(f"cache batch {cache.k.shape[2]} != tokens batch {tokens.shape[0]}")
    return _compiled("extend", model_cfg, comm, mesh)(params_stacked, tokens, cache)


def decode_step(params_stacked, tokens, cache: KVCache, model_cfg: ModelConfig,
                comm: CommConfig, mesh: Optional[Mesh] = None):
    """One decoding step: tokens int [B] (the last sampled token of each sequence).

    Returns:
      (logits fp32 [B, V] for the next token, updated cache).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"decode_step: tokens must be int [B], got shape {tokens.shape}")
    logits, cache = prefill(params_stacked, tokens[:, None], cache, model_cfg, comm, mesh)
    return logits[:, 0], cache


# --------------------------------------------------------------------------------------------
# Unsharded reference (plain jnp, no TP, no Flax): the parity target of the tests


def apply_reference(full_params, tokens, cfg: ModelConfig, site_offsets=None):
    """Logits of the full model written out in plain jnp, one layer after the other.

    Args:
      full_params: unsharded parameters (`init_params` / the loaders).
      tokens: int [B, T].
      cfg: the model config (its compute dtype is used).
      site_offsets: optional [2 L, B, T, D] added to the block outputs (site 2l: layer l's
        attention output, 2l + 1: its MLP output) before the residual adds. Zeros change
        nothing; the gradient with respect to them is the loss's sensitivity to each site's sum
        (`models.calibrate`).

    Returns:
      logits fp32 [B, T, V].
    """
    _check_tokens(tokens, cfg)
    dt = jnp.dtype(cfg.dtype)
    p = jax.tree.map(lambda a: jnp.asarray(a), full_params)
    b, t = tokens.shape
    hd, groups = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    pos = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(pos, hd, cfg.rope_base)
    emb = p["embed"]["embedding"]
    h = emb[tokens].astype(dt)                                  # [B, T, D]
    lp = p["layers"]
    for i in range(cfg.n_layers):
        at = lp["attn"]
        x = rms_norm(h, lp["attn_norm"]["scale"][i], cfg.norm_eps).astype(dt)
        q = (x @ at["q_proj"]["kernel"][i].astype(dt)).reshape(b, t, cfg.n_heads, hd)
        k = (x @ at["k_proj"]["kernel"][i].astype(dt)).reshape(b, t, cfg.n_kv_heads, hd)
        v = (x @ at["v_proj"]["kernel"][i].astype(dt)).reshape(b, t, cfg.n_kv_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, at["q_norm"]["scale"][i], cfg.norm_eps).astype(dt)
            k = rms_norm(k, at["k_norm"]["scale"][i], cfg.norm_eps).astype(dt)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = jnp.repeat(k, groups, axis=2)                       # [B, T, H, hd] (HF repeat_kv)
        v = jnp.repeat(v, groups, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=F32) / math.sqrt(hd)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1).astype(dt), v)
        out = a.reshape(b, t, -1) @ at["o_proj"]["kernel"][i].astype(dt)
        h = h + (out if site_offsets is None else out + site_offsets[2 * i].astype(dt))
        ml = lp["mlp"]
        x = rms_norm(h, lp["mlp_norm"]["scale"][i], cfg.norm_eps).astype(dt)
        g = x @ ml["gate_proj"]["kernel"][i].astype(dt)
        u = x @ ml["up_proj"]["kernel"][i].astype(dt)
        out = (jax.nn.silu(g) * u) @ ml["down_proj"]["kernel"][i].astype(dt)
        h = h + (out if site_offsets is None else out + site_offsets[2 * i + 1].astype(dt))
    h = rms_norm(h, p["final_norm"]["scale"], cfg.norm_eps).astype(dt)
    head = emb.T if cfg.tie_embeddings else p["lm_head"]        # [D, V]
    return jnp.einsum("btd,dv->btv", h, head.astype(dt), preferred_element_type=F32)


def reference_loss(full_params, tokens, targets, cfg: ModelConfig, mask=None):
    """Cross-entropy of `apply_reference` (for gradient parity tests)."""
    return cross_entropy(apply_reference(full_params, tokens, cfg), targets, mask)


__all__ = [
    "KVCache", "ForwardOutput", "Transformer", "DecoderLayer", "Attention", "MLP", "RMSNorm",
    "rms_norm", "rope_tables", "apply_rope", "attention", "state_norm",
    "param_shapes", "shard_axis", "init_params", "shard_params", "unshard_params",
    "check_params", "place_params",
    "forward_local", "forward_with_taps", "SiteValues", "TappedForward", "loss_local",
    "cross_entropy", "run_per_rank", "jit_per_rank",
    "compiler_options", "CPU_COMPILER_OPTIONS", "f_site", "g_site", "materialize_cotangent",
    "apply_sharded", "apply_simulated", "loss_and_grad_sharded", "loss_and_grad_simulated",
    "tp_global_norm", "init_opt_state", "make_train_step",
    "init_cache", "prefill", "decode_step",
    "apply_reference", "reference_loss",
]
