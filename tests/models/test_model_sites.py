"""The model's TP sites and the Flax layers' sites are one implementation (docs/models.md).

`models/model.py` holds its own projections and reaches `echo_jax.tp.backward_site` /
`forward_site` through `f_site` / `g_site`; `echo_jax.flax.linen.ColumnParallelDense` /
`RowParallelDense` reach the same two functions through `echo_jax.flax.column_parallel` /
`row_parallel`. With the tiny preset's weights at P = 4, per rank inside `jax.shard_map` (the
model's runner `M.jit_per_rank` for both, so only the site code differs), in exact mode (config
None) and Echo 4-bit compensated (the Echo paper, arXiv 2610.14277):

* the model's MLP block (f_site -> `M.MLP` -> g_site, two blocks in a row so the second meets a
  live forward state) and the same block built from the layers (two column layers, gate and up,
  and one row layer on one `EchoCarrier`) give the same output and the same new forward state,
  bit for bit, from the same parameter tree (the names match: gate_proj, up_proj, down_proj);
* one column projection (the model's f_site + its Dense against `ColumnParallelDense`) and one
  row projection (the model's Dense + g_site against `RowParallelDense`, the carrier holding the
  same nonzero forward state as the model's site) give the same output, new states and
  gradients (input, kernel, and the final backward state: the gradient with respect to the
  initial one), bit for bit;
* exact mode equals the unsharded computation in float64 to fp32 rounding, and 4-bit differs
  from exact (the config reaches the sites).

Gradients are compared for one projection, not for the MLP block: the model applies one f site
before gate and up (one backward all-reduce of the summed cotangent), the layers one per column
layer (two all-reduces, then the sum), so the block's input gradients differ by design.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax.flax import linen as ejnn
from conftest import make_mesh
from models import config as C
from models import model as M

CFG = C.get_config("tiny")                  # dim 64, ffn 192, 2 layers, fp32
TP = 4
B, T = 2, 8
ECHO4 = ej.EchoConfig(bits=4)
CONFIGS = {"exact": None, "echo4": ECHO4}


def bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(x, y))
        for x, y in zip(la, lb))


def mesh():
    return make_mesh((TP,), ("tp",))


def comm_of(config):
    return C.CommConfig(tp=TP, echo=config)


def per_rank(fn, comm, stacked_in):
    """fn per rank under shard_map over "tp" (the model's runner), every output stacked [P, ...]."""
    return M.jit_per_rank(fn, comm, mesh(), stacked_in=stacked_in, stacked_out=True)


@pytest.fixture(scope="module")
def weights():
    """(full MLP params of the tiny preset {name: [L, in, out]}, the same sharded [P, L, ...])."""
    full = M.init_params(jax.random.key(0), CFG)["layers"]["mlp"]
    full = jax.tree.map(np.asarray, full)
    sharded = M.shard_params({"layers": {"mlp": full}}, TP)["layers"]["mlp"]
    return full, sharded


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --------------------------------------------------------------------------------------------
# the two implementations of a block


def model_blocks(config, cfg=CFG):
    """The model's MLP blocks (as in `M.DecoderLayer`, without the norm): per rank
    h -> h + g_site(MLP(f_site(h))) for each layer; returns (h, forward state)."""
    comm = comm_of(config)

    def fn(params, h):                                        # params: {name: {kernel: [L, ...]}}
        fwd = ej.init_state(h, dtype=comm.state_dtype)
        bwd = ej.init_state(h, dtype=comm.state_dtype)
        for layer in range(cfg.n_layers):
            p = jax.tree.map(lambda a: a[layer], params)
            x, bwd = M.f_site(h, comm, comm.backward_configs(), bwd, None)
            part = M.MLP(cfg, comm).apply({"params": p}, x)
            y, fwd = M.g_site(part, comm, comm.forward_configs(), fwd, None)
            h = h + y
        return h, fwd

    return per_rank(fn, comm, (True, False))


class LayersMLP(nn.Module):
    """The MLP block from the Flax layers: gate and up column-parallel, down row-parallel."""

    cfg: Any
    config: Any
    echo: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype),
                  param_dtype=jnp.dtype(cfg.param_dtype), config=self.config, echo=self.echo)
        gate = ejnn.ColumnParallelDense(cfg.ffn_dim, name="gate_proj", **kw)(x)
        up = ejnn.ColumnParallelDense(cfg.ffn_dim, name="up_proj", **kw)(x)
        return ejnn.RowParallelDense(cfg.dim, name="down_proj", **kw)(nn.silu(gate) * up)


class LayersBlocks(nn.Module):
    """`model_blocks` from the layers: one carrier, reset per pass, h -> h + LayersMLP(h)."""

    cfg: Any
    config: Any

    @nn.compact
    def __call__(self, h):
        echo = ejnn.EchoCarrier(self.config, name="echo")
        echo.reset(h)
        for layer in range(self.cfg.n_layers):
            h = h + LayersMLP(self.cfg, self.config, echo, name=f"mlp{layer}")(h)
        return h


def layers_blocks(config, cfg=CFG):
    comm = comm_of(config)

    def fn(params, h):
        p = {f"mlp{layer}": jax.tree.map(lambda a: a[layer], params)
             for layer in range(cfg.n_layers)}
        h, st = LayersBlocks(cfg, config).apply({"params": p}, h, mutable=[ejnn.COLLECTION])
        return h, st[ejnn.COLLECTION]["echo"]["fwd"]

    return per_rank(fn, comm, (True, False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_mlp_block_model_equals_layers(name, dtype, weights):
    """Two MLP blocks: the model's sites and the layers' give the same output and forward state,
    bit for bit (fp32, and bf16 compute: both promote as `nn.Dense` and reduce bf16 partial
    sums); exact fp32 is the unsharded float64 computation to fp32 rounding."""
    full, sharded = weights
    config, cfg = CONFIGS[name], CFG.replace(dtype=dtype)
    h = normal(1, (B, T, cfg.dim)).astype(dtype)
    y_model, fwd_model = model_blocks(config, cfg)(sharded, h)
    y_layers, fwd_layers = layers_blocks(config, cfg)(sharded, h)
    assert y_model.shape == (TP, B, T, cfg.dim) and y_model.dtype == jnp.dtype(dtype)
    assert fwd_model.m1.shape == (TP, B, T, cfg.dim)
    assert bits_equal(y_model, y_layers), "outputs differ"
    assert bits_equal(fwd_model, fwd_layers), "forward states differ"
    if config is not None:
        assert float(jnp.max(jnp.abs(fwd_model.m1))) > 0       # the state is live
        y_exact, _ = model_blocks(None, cfg)(sharded, h)
        assert not bits_equal(y_model, y_exact)                # 4 bits reached the sites
    elif dtype == "float32":
        ref = np.asarray(h, np.float64)
        for layer in range(cfg.n_layers):
            w = {k: v["kernel"][layer].astype(np.float64) for k, v in full.items()}
            g, u = ref @ w["gate_proj"], ref @ w["up_proj"]
            ref = ref + (g / (1 + np.exp(-g)) * u) @ w["down_proj"]
        for r in range(TP):
            np.testing.assert_allclose(y_model[r], ref, rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------------------------
# one projection: output, states and gradients


class LayersOne(nn.Module):
    """One layer ("column": gate_proj, "row": down_proj) on a carrier whose state comes in with
    the variables (no reset: the test gives the carrier the model's state)."""

    kind: str
    config: Any

    @nn.compact
    def __call__(self, x):
        echo = ejnn.EchoCarrier(self.config, name="echo")
        kw = dict(use_bias=False, dtype=jnp.dtype(CFG.dtype),
                  param_dtype=jnp.dtype(CFG.param_dtype), config=self.config, echo=echo)
        if self.kind == "column":
            return ejnn.ColumnParallelDense(CFG.ffn_dim, name="gate_proj", **kw)(x)
        return ejnn.RowParallelDense(CFG.dim, name="down_proj", **kw)(x)


def one_model(kind, config):
    """Per rank: the model's f_site + Dense ("column") or Dense + g_site ("row"); returns
    (y, new forward state, d/dkernel, d/dx, d/d(initial backward state)) of sum(sin(y))."""
    comm = comm_of(config)
    name, features = ("gate_proj", CFG.ffn_dim // TP) if kind == "column" else \
        ("down_proj", CFG.dim)

    def fn(kernel, x, fwd, bwd):
        def loss(kernel, x, bwd):
            dense = M._dense(features, name, CFG)             # the model's projection
            if kind == "column":
                x, _ = M.f_site(x, comm, comm.backward_configs(), bwd, None)
                y, new_fwd = dense.apply({"params": {"kernel": kernel}}, x), fwd
            else:
                part = dense.apply({"params": {"kernel": kernel}}, x)
                y, new_fwd = M.g_site(part, comm, comm.forward_configs(), fwd, None)
            return jnp.sum(jnp.sin(y)), (y, new_fwd)

        (_, (y, new_fwd)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
            kernel, x, bwd)
        return (y, new_fwd) + grads

    return per_rank(fn, comm, (True, kind == "row", True, True))


def one_layers(kind, config):
    """`one_model` from the layers: the carrier holds (fwd, bwd) as the variables give them."""
    comm = comm_of(config)
    name = "gate_proj" if kind == "column" else "down_proj"
    module = LayersOne(kind, config)

    def fn(kernel, x, fwd, bwd):
        def loss(kernel, x, bwd):
            variables = {"params": {name: {"kernel": kernel}},
                         ejnn.COLLECTION: {"echo": {"fwd": fwd, "bwd": bwd}}}
            y, st = module.apply(variables, x, mutable=[ejnn.COLLECTION])
            return jnp.sum(jnp.sin(y)), (y, st[ejnn.COLLECTION]["echo"]["fwd"])

        (_, (y, new_fwd)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
            kernel, x, bwd)
        return (y, new_fwd) + grads

    return per_rank(fn, comm, (True, kind == "row", True, True))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_one_projection_model_equals_layers(kind, name, weights):
    """One column (f) or row (g) projection: the model's site and the layer's give the same
    output, forward state and gradients (input, kernel, initial backward state), bit for bit,
    from the same nonzero forward state; exact mode is the unsharded float64 computation to fp32
    rounding."""
    full, sharded = weights
    config = CONFIGS[name]
    if kind == "column":
        kernel, w = sharded["gate_proj"]["kernel"][:, 0], full["gate_proj"]["kernel"][0]
        x = normal(2, (B, T, CFG.dim))                        # replicated input
        x_rank = np.broadcast_to(np.asarray(x), (TP,) + x.shape)
    else:
        kernel, w = sharded["down_proj"]["kernel"][:, 0], full["down_proj"]["kernel"][0]
        x_full = normal(2, (B, T, CFG.ffn_dim))               # the hidden activations, split
        x = x_rank = np.stack(np.split(np.asarray(x_full), TP, axis=-1))
    shape = (TP, B, T, CFG.dim)
    fwd = ej.CompensatorState(normal(3, shape, 0.01), normal(4, shape, 0.01))  # a live state
    bwd = ej.init_state(jax.ShapeDtypeStruct(shape, jnp.float32))

    got_model = one_model(kind, config)(kernel, x, fwd, bwd)
    got_layers = one_layers(kind, config)(kernel, x, fwd, bwd)
    names = ("y", "forward state", "d/dkernel", "d/dx", "final backward state")
    for what, a, b in zip(names, got_model, got_layers):
        assert bits_equal(a, b), f"{kind} {name}: {what} differs"

    y, new_fwd, dk, dx, final_bwd = got_model
    if kind == "row" or config is None:
        assert bits_equal(final_bwd, bwd)                     # no backward site compensated
    if kind == "column" or config is None:
        assert bits_equal(new_fwd, fwd)                       # no forward site compensated
    if config is None:
        w64, x64 = w.astype(np.float64), np.asarray(x_rank, np.float64)
        if kind == "column":
            ys = [x64[r] @ np.split(w64, TP, axis=-1)[r] for r in range(TP)]
            dx_ref = sum(np.cos(yr) @ np.split(w64, TP, axis=-1)[r].T for r, yr in enumerate(ys))
            dk_ref = [np.einsum("btd,btf->df", x64[r], np.cos(ys[r])) for r in range(TP)]
            dx_ref = [dx_ref] * TP
        else:
            ys = [sum(x64[r] @ np.split(w64, TP, axis=0)[r] for r in range(TP))] * TP
            dx_ref = [np.cos(ys[0]) @ np.split(w64, TP, axis=0)[r].T for r in range(TP)]
            dk_ref = [np.einsum("btf,btd->fd", x64[r], np.cos(ys[0])) for r in range(TP)]
        for r in range(TP):
            np.testing.assert_allclose(y[r], ys[r], rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(dx[r], dx_ref[r], rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(dk[r], dk_ref[r], rtol=2e-5, atol=2e-5)
    else:
        exact = one_model(kind, None)(kernel, x, fwd, bwd)
        if kind == "column":                                  # 4 bits on the cotangent
            assert float(jnp.max(jnp.abs(final_bwd.m1))) > 0
            assert not bits_equal(dx, exact[3])
        else:                                                 # 4 bits on the partial sums
            assert not bits_equal(new_fwd, fwd) and not bits_equal(y, exact[0])
