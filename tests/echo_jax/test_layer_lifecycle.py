"""The Flax layers in a user's model: the state's life cycle, checkpoints, names, the fused layer.

On the 8 fake CPU devices, a ("dp", "tp") = (2, 4) mesh:

* the compensator state is scratch, not model state: its size is the formula of
  docs/your_model.md (2 directions x (m1, m2) of the reduced value's shape, [P, ...] under a
  mesh, in the state dtype); a checkpoint of the documented filter (Linen `without_state`, NNX
  `nnx.state(model, nnx.Not(EchoState))`) saved at batch 8 restores into a batch-2 model with
  orbax and round-trips through `flax.serialization`;
* NNX decoding under `nnx.jit` compiles once per input shape when the pass ends with
  `carrier.clear()` (without it the stale state of the previous pass is a jit input and adds
  compiles);
* drop-in names: auto-named Linen layers are `Dense_0`, ... as the `nn.Dense`s they replace (a
  plain Flax checkpoint loads and gives the same outputs); the NNX layers' parameters are
  `nnx.Linear`'s `kernel` and `bias`;
* the fused column layer runs one backward Echo all-reduce where three column layers run three,
  and equals them (outputs, gradients) in exact mode and against the unsharded Dense reference.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import gspmd
from echo_jax.flax import linen as ejnn
from echo_jax.flax import nnx as ejnnx
from conftest import make_mesh

D, H = 64, 128
CFG4 = ej.EchoConfig(bits=4)


def mesh():
    return make_mesh((2, 4), ("dp", "tp"))


def inputs(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def nbytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def echo_calls(fn, *args):
    """The Echo collectives of fn's compiled program (custom calls of the CPU transport)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [op for op in gspmd.collective_ops(text) if op["op"] == "echo"]


class LinenMLP(nn.Module):
    """A residual MLP block with auto-named layers; `dense=True`: the plain nn.Dense model."""

    config: object = None
    dense: bool = False

    @nn.compact
    def __call__(self, x):
        if self.dense:
            h = nn.Dense(H)(x)
            return x + nn.Dense(D)(nn.gelu(h))
        echo = ejnn.EchoCarrier(self.config, name="echo")
        echo.reset(x)
        h = ejnn.ColumnParallelDense(H, config=self.config, echo=echo)(x)
        return x + ejnn.RowParallelDense(D, config=self.config, echo=echo)(nn.gelu(h))


class NNXMLP(nnx.Module):
    def __init__(self, config=None, *, clear=False, rngs):
        self.echo = ejnnx.EchoCarrier(config)
        self.clear = clear
        self.up = ejnnx.ColumnParallelLinear(D, H, config=config, echo=self.echo, rngs=rngs)
        self.down = ejnnx.RowParallelLinear(H, D, config=config, echo=self.echo, rngs=rngs)

    def __call__(self, x):
        self.echo.reset(x)
        y = x + self.down(nnx.gelu(self.up(x)))
        if self.clear:
            self.echo.clear()
        return y


# --------------------------------------------------------------------------------------------
# row 5: the state's size; checkpoints hold the parameters only


def test_state_size_is_the_formula():
    """2 directions x (m1, m2) of the reduced value's shape: per rank (shard_map) x's shape,
    [P, *x.shape] under a mesh; 4 bytes a value in fp32, 2 in bf16."""
    x = inputs((8, 16, D))
    for cfg, size in ((CFG4, 4), (CFG4.replace(state_dtype="bfloat16"), 2)):
        v = LinenMLP(cfg).init(jax.random.key(0), x)
        assert nbytes(v["echo_state"]) == 4 * x.size * size          # no mesh: x's shape
        with jax.set_mesh(mesh()):
            _, st = jax.jit(lambda p, x: LinenMLP(cfg).apply(p, x, mutable=["echo_state"]))(
                {"params": v["params"]}, x)
        assert st["echo_state"]["echo"]["fwd"].m1.shape == (4,) + x.shape
        assert nbytes(st["echo_state"]) == 4 * 4 * x.size * size      # [P, *x.shape]
    specs = nn.get_partition_spec({"params": v["params"]})
    per_rank = jax.jit(jax.shard_map(
        lambda p, x: jax.tree.map(lambda a: a[None], LinenMLP(CFG4).apply(
            p, x, mutable=["echo_state"])[1]["echo_state"]["echo"]["fwd"].m1),
        mesh=mesh(), in_specs=(specs, P("dp")), out_specs=P("tp", "dp")))
    assert per_rank({"params": v["params"]}, x).shape == (4, 8, 16, D)   # per rank [4, 16, D]


def test_linen_checkpoint_without_state_restores_at_another_batch(tmp_path):
    """init at batch 8 returns the state with the parameters; `without_state` drops it (half the
    its 4 arrays like x); orbax restores that checkpoint into a batch-2 model's target, and
    flax.serialization round-trips it; the restored model gives the saved model's outputs."""
    model = LinenMLP(CFG4)
    x8 = inputs((8, 16, D))
    variables = model.init(jax.random.key(0), x8)
    saved = ejnn.without_state(variables)
    assert set(saved) == {"params"} and "echo_state" in variables
    assert nbytes(variables) - nbytes(saved) == 4 * x8.size * 4    # 4 fp32 arrays like x

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "linen", saved)
    ckpt.wait_until_finished()
    x2 = inputs((2, 16, D), seed=2)
    target = ejnn.without_state(model.init(jax.random.key(9), x2))
    restored = ckpt.restore(tmp_path / "linen", target)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), restored, saved))

    blob = serialization.to_bytes(saved)
    again = serialization.from_bytes(target, blob)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), again, saved))

    apply = jax.jit(lambda v, x: model.apply(v, x, mutable=["echo_state"])[0])
    np.testing.assert_array_equal(apply(restored, x2), apply(saved, x2))
    np.testing.assert_array_equal(apply(again, x2), apply(saved, x2))


def test_nnx_checkpoint_without_state_restores_at_another_batch(tmp_path):
    """The NNX filter: a model that ran at batch 8 saves its state without `EchoState`; orbax
    restores it into a fresh model that then runs at batch 2 with the saved parameters."""
    model = NNXMLP(CFG4, rngs=nnx.Rngs(0))
    model(inputs((8, 16, D)))
    assert model.echo.fwd.get_value() is not None         # the pass left a state
    saved = ejnnx.without_state(model)
    assert nbytes(saved) == nbytes(nnx.state(model, nnx.Param))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "nnx", saved)
    ckpt.wait_until_finished()

    fresh = NNXMLP(CFG4, rngs=nnx.Rngs(7))
    restored = ckpt.restore(tmp_path / "nnx", ejnnx.without_state(fresh))
    nnx.update(fresh, restored)
    x2 = inputs((2, 16, D), seed=2)
    np.testing.assert_array_equal(fresh(x2), model(x2))
    assert jax.tree.structure(nnx.state(model, nnx.Not(ejnnx.EchoState))) == \
        jax.tree.structure(saved)                          # MODEL_STATE is that filter


# --------------------------------------------------------------------------------------------
# row 8: decoding under nnx.jit compiles once per shape


def test_nnx_decoding_compiles_once_per_shape():
    """Greedy decoding (a prefill of T tokens, then one-token steps), two generate calls with
    prompts of 5 and 3 tokens, one nnx.jit step: with the pass ending in `carrier.clear()` it
    traces once per input shape (T = 5, T = 3, one token); without, the state the previous pass
    left is an input of another shape and adds traces; the outputs are the same bits."""
    def generate_traces(clear):
        traces = []

        @nnx.jit
        def step(model, x):
            traces.append(x.shape)              # runs once per trace (= per compile)
            return model(x)

        with jax.set_mesh(mesh()):
            model = NNXMLP(CFG4, clear=clear, rngs=nnx.Rngs(0))
            outs = []
            for t in (5, 3):
                h = step(model, inputs((2, t, D), seed=t))
                for _ in range(3):
                    h = step(model, h[:, -1:])
                    outs.append(h)
        return traces, outs

    traces, outs = generate_traces(clear=True)
    assert sorted(traces) == sorted([(2, 5, D), (2, 3, D), (2, 1, D)]), traces
    stale, outs_stale = generate_traces(clear=False)
    assert len(stale) > len(traces), stale       # what clear saves: the stale state's compiles
    assert all(bool(jnp.all(a == b)) for a, b in zip(outs, outs_stale))


# --------------------------------------------------------------------------------------------
# row 6: drop-in names


def test_linen_auto_names_are_dense_and_a_dense_checkpoint_loads():
    """Auto-named Echo layers take nn.Dense's names (Dense_0, Dense_1), so the parameters of the
    plain nn.Dense model load as they are and give its outputs (exact mode, under a mesh)."""
    x = inputs((8, D))
    plain = LinenMLP(dense=True).init(jax.random.key(0), x)["params"]
    echo = nn.unbox(LinenMLP().init(jax.random.key(0), x)["params"])
    assert jax.tree.structure(plain) == jax.tree.structure(echo)
    assert set(plain) == {"Dense_0", "Dense_1"}
    ref = LinenMLP(dense=True).apply({"params": plain}, x)
    with jax.set_mesh(mesh()):
        y = jax.jit(lambda p, x: LinenMLP(None).apply({"params": p}, x,
                                                       mutable=["echo_state"])[0])(plain, x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    # Lifted classes and explicit names follow nn.Dense's too; a user's subclass keeps its own.

    class Named(nn.Module):
        @nn.compact
        def __call__(self, x):
            class MyDense(ejnn.ColumnParallelDense):
                pass
            x = nn.remat(ejnn.ColumnParallelDense)(H)(x)
            x = ejnn.RowParallelDense(D, name="down")(x)
            return MyDense(H)(x)

    names = set(Named().init(jax.random.key(0), x)["params"])
    assert names == {"CheckpointDense_0", "down", "MyDense_0"}, names


def test_nnx_parameter_names_are_linear():
    """The NNX layers' parameters are nnx.Linear's (`kernel`, `bias`): a Linear's state loads."""
    x = inputs((8, D))
    for cls in (ejnnx.ColumnParallelLinear, ejnnx.RowParallelLinear):
        ours, theirs = cls(D, H, rngs=nnx.Rngs(5)), nnx.Linear(D, H, rngs=nnx.Rngs(6))
        assert set(nnx.to_pure_dict(nnx.state(ours, nnx.Param))) == {"kernel", "bias"}
        nnx.update(ours, nnx.state(theirs, nnx.Param))
        np.testing.assert_array_equal(ours(x), theirs(x))


# --------------------------------------------------------------------------------------------
# row 7: the fused column layer


class LinenQKV(nn.Module):
    """q, k, v of one input: one fused layer, or three column layers; then a row layer of
    their product (so each output reaches the loss)."""

    config: object = None
    fused: bool = True

    @nn.compact
    def __call__(self, x):
        kw = dict(config=self.config, kernel_init=nn.initializers.normal(0.1),
                  bias_init=nn.initializers.normal(0.5), precision=jax.lax.Precision.HIGHEST)
        if self.fused:
            q, k, v = ejnn.FusedColumnParallelDense((H, H, 2 * H), name="qkv", **kw)(x)
        else:
            q = ejnn.ColumnParallelDense(H, name="q", **kw)(x)
            k = ejnn.ColumnParallelDense(H, name="k", **kw)(x)
            v = ejnn.ColumnParallelDense(2 * H, name="v", **kw)(x)
        return q, k, v


def to_separate(params):
    """The fused layer's parameters as the three column layers' (`kernel_i` -> layer i)."""
    return {n: {"kernel": params["qkv"][f"kernel_{i}"], "bias": params["qkv"][f"bias_{i}"]}
            for i, n in enumerate("qkv")}


def qkv_loss(model):
    def loss(p, x):
        q, k, v = model.apply({"params": p}, x)
        return jnp.sum(jnp.sin(q * k)) + jnp.sum(jnp.cos(v))
    return loss


def test_fused_column_layer_runs_one_echo_all_reduce():
    """The compiled gradient of the fused layer has one Echo collective, three column layers'
    three (gspmd mode, 4 bits)."""
    x = inputs((8, D))
    v = LinenQKV(CFG4).init(jax.random.key(0), x)["params"]
    with jax.set_mesh(mesh()):
        fused = echo_calls(jax.grad(qkv_loss(LinenQKV(CFG4)), argnums=(0, 1)), v, x)
        separate = echo_calls(jax.grad(qkv_loss(LinenQKV(CFG4, fused=False)), argnums=(0, 1)),
                              to_separate(v), x)
    assert len(fused) == 1 and len(separate) == 3, (fused, separate)


@pytest.mark.parametrize("mode", ("gspmd", "shard_map"))
def test_fused_column_layer_equals_three_column_layers(mode):
    """Exact mode: the fused layer's outputs are the three layers' and the unsharded Dense's,
    its gradients theirs to fp32 rounding (one all-reduce of the summed cotangent instead of
    three); each rank holds its slice of each of q, k and v."""
    x = inputs((8, D))
    v = nn.unbox(LinenQKV().init(jax.random.key(0), x)["params"])
    sep = to_separate(v)
    dense = {n: {"kernel": sep[n]["kernel"], "bias": sep[n]["bias"]} for n in "qkv"}

    def ref_loss(p, x):
        q, k, vv = (x @ p[n]["kernel"] + p[n]["bias"] for n in "qkv")
        return jnp.sum(jnp.sin(q * k)) + jnp.sum(jnp.cos(vv))

    ref_g = jax.grad(ref_loss, argnums=(0, 1))(dense, x)
    ref_out = [x @ dense[n]["kernel"] + dense[n]["bias"] for n in "qkv"]

    def run(model, p):
        if mode == "gspmd":
            out = jax.jit(lambda p, x: model.apply({"params": p}, x))(p, x)
            g = jax.jit(jax.grad(qkv_loss(model), argnums=(0, 1)))(p, x)
            return out, g
        boxed = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x))

        def per_rank(p, x):
            q, k, vv = model.apply({"params": p}, x)
            return q, k, vv

        sm = jax.shard_map(per_rank, mesh=mesh(), in_specs=(boxed["params"], P("dp")),
                           out_specs=(P("dp", "tp"),) * 3)
        out = jax.jit(sm)(p, x)

        def loss(p, x):
            q, k, vv = sm(p, x)
            return jnp.sum(jnp.sin(q * k)) + jnp.sum(jnp.cos(vv))
        return out, jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)

    with jax.set_mesh(mesh()):
        out_f, (g_f, gx_f) = run(LinenQKV(None), v)
        out_s, (g_s, gx_s) = run(LinenQKV(None, fused=False), sep)
    for a, b, r in zip(out_f, out_s, ref_out):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx_f, gx_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx_f, ref_g[1], rtol=1e-5, atol=1e-5)
    for got, want in ((to_separate(g_f), g_s), (to_separate(g_f), ref_g[0])):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_nnx_fused_column_layer():
    """NNX: the fused layer draws the three Linears' values from the same rngs, equals them
    under a mesh (exact mode), and its gradient runs one Echo collective (4 bits)."""
    x = inputs((8, D))
    with jax.set_mesh(mesh()):
        fused = ejnnx.FusedColumnParallelLinear(D, (H, H, 2 * H), rngs=nnx.Rngs(0))
        rngs = nnx.Rngs(0)
        linears = [nnx.Linear(D, f, rngs=rngs) for f in (H, H, 2 * H)]
        for i, lin in enumerate(linears):
            np.testing.assert_array_equal(getattr(fused, f"kernel_{i}")[...], lin.kernel[...])
            np.testing.assert_array_equal(getattr(fused, f"bias_{i}")[...], lin.bias[...])
        outs = nnx.jit(lambda m, x: m(x))(fused, x)
        for out, lin in zip(outs, linears):
            np.testing.assert_allclose(out, lin(x), rtol=1e-5, atol=1e-5)
        assert outs[0].sharding.spec[-1] == "tp"

        layer4 = ejnnx.FusedColumnParallelLinear(D, (H, H, 2 * H), config=CFG4,
                                                 rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer4)

        def loss(params, x):
            q, k, v = nnx.merge(graphdef, params)(x)
            return jnp.sum(jnp.sin(q * k)) + jnp.sum(jnp.cos(v))

        assert len(echo_calls(jax.grad(loss, argnums=(0, 1)), params, x)) == 1
