"""Flax layers with Echo (`echo_jax.flax.linen`, `echo_jax.flax.nnx`; docs/your_model.md).

On the 8 fake CPU devices, a ("dp", "tp") = (2, 4) mesh, both places a layer runs: per rank inside
`jax.shard_map` ("shard_map" mode) and in a jit program under `jax.set_mesh` ("gspmd" mode).

* Parity with `flax.linen.Dense` / `nnx.Linear` on the unsharded model with the same parameters
  (the layers also initialize to the same values from the same key / `nnx.Rngs`): the
  column-parallel layer's output bit for bit (each output feature is the same dot product over
  the whole input); the row-parallel layer's to fp32 rounding (each rank sums its in / P
  features and the all-reduce adds the P partial sums: another order of additions than Dense's
  one dot); gradients of the exact mode to fp32 rounding; 8-bit compensated within a loose bound.
* A 2-layer model with `nn.scan` / `nnx.scan` over layers (and remat) equals the same model
  unrolled bit for bit (loss, forward state, gradients), with the early-8-bit per-layer policy.
* The state flows: nonzero after a pass, reset by the next (the same output again), the same
  bits as the sites threaded by hand with `echo_jax.tp` (the backward state through the
  cotangent), new shapes per pass (KV-cache decoding), the config's state dtype.
* Every ```python block of docs/your_model.md marked "# runs as a test" runs as it stands.
"""

import re
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import tp
from echo_jax.flax import linen as ejnn
from echo_jax.flax import nnx as ejnnx
from conftest import make_mesh

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_model.md"
B, D, H = 8, 64, 128           # batch, model dim, hidden dim
CFG4 = ej.EchoConfig(bits=4)
CFG8 = ej.EchoConfig(bits=8)
MODES = ("shard_map", "gspmd")
KINIT = nn.initializers.normal(0.1)    # a kernel_init of the user's (not the default)
BINIT = nn.initializers.normal(0.5)    # a nonzero bias: the row bias must be added once


def mesh():
    return make_mesh((2, 4), ("dp", "tp"))


def bits_equal(a, b):
    return all(bool(jnp.all(x == y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_rel(a, b):
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def inputs(seed=1, shape=(B, D)):
    return jax.random.normal(jax.random.key(seed), shape)


# --------------------------------------------------------------------------------------------
# Linen models: one MLP block (column then row), a stack of them (unrolled or nn.scan)


class LinenMLP(nn.Module):
    """x -> ColumnParallelDense(H) -> gelu -> RowParallelDense(D); returns (h, y)."""

    config: object = None
    dense: bool = False          # the unsharded reference: flax.linen.Dense with the same names

    @nn.compact
    def __call__(self, x):
        kw = dict(kernel_init=KINIT, bias_init=BINIT, precision=jax.lax.Precision.HIGHEST)
        if self.dense:
            h = nn.Dense(H, name="up", **kw)(x)
            return h, nn.Dense(D, name="down", **kw)(nn.gelu(h))
        echo = ejnn.EchoCarrier(self.config, name="echo")
        echo.reset(x)
        h = ejnn.ColumnParallelDense(H, config=self.config, echo=echo, name="up", **kw)(x)
        return h, ejnn.RowParallelDense(D, config=self.config, echo=echo, name="down", **kw)(
            nn.gelu(h))


class LinenBlock(nn.Module):
    """A residual MLP block as an `nn.scan` body: (x, layer) -> (x, None)."""

    config: object = None
    echo: object = None

    @nn.compact
    def __call__(self, x, layer):
        choice = layer if isinstance(self.config, tuple) else None
        h = ejnn.ColumnParallelDense(H, config=self.config, echo=self.echo, name="up")(
            x, choice=choice)
        y = ejnn.RowParallelDense(D, config=self.config, echo=self.echo, name="down")(
            nn.gelu(h), choice=choice)
        return x + y, None


class LinenStack(nn.Module):
    """L blocks, scanned (`variable_carry="echo_state"`) or unrolled, each block under nn.remat;
    `configs` (one per layer, static) replaces `config` in the unrolled stack. (Remat on both
    sides: with it on one side only, XLA:CPU fuses the elementwise backward of the column layers
    differently and their weight gradients differ in the last bit.)"""

    config: object = None
    layers: int = 2
    scan: bool = False
    configs: tuple = ()
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        echo = ejnn.EchoCarrier(self.config, name="echo")
        echo.reset(x)
        if self.scan:
            stack = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0},
                            variable_carry="echo_state", split_rngs={"params": True},
                            length=self.layers, metadata_params={nn.PARTITION_NAME: None})
            x, _ = stack(self.config, echo, name="layers")(x, jnp.arange(self.layers))
            return x
        for i in range(self.layers):
            cfg = self.configs[i] if self.configs else self.config
            block = nn.remat(LinenBlock) if self.remat else LinenBlock
            x, _ = block(cfg, echo, name=f"layer{i}")(x, jnp.int32(i))
        return x


def unstack(params, layers):
    """Scanned params {"layers": [L, ...]} -> unrolled {"layer{i}": [...]} (the partitioning
    names lose the layer axis)."""
    def take(b, i):
        if isinstance(b, nn.Partitioned):
            return nn.Partitioned(b.value[i], b.names[1:], b.mesh)
        return b[i]

    return {f"layer{i}": jax.tree.map(lambda b: take(b, i), params["layers"],
                                      is_leaf=lambda b: isinstance(b, nn.Partitioned))
            for i in range(layers)}


def linen_run(module, variables, x, mode, *, grad=False, state=False):
    """module.apply in a mode: per rank inside shard_map (params sharded by their partitioning
    names, x by "dp"), or jit under jax.set_mesh. Returns (output, [echo_state], [grads of
    sum(sin(y)) w.r.t. (params, x)]) as asked."""
    m = mesh()

    def apply(v, x):
        out, st = module.apply(v, x, mutable=[ejnn.COLLECTION])
        return out, st[ejnn.COLLECTION]

    if mode == "shard_map":
        specs = nn.get_partition_spec(variables)

        def per_rank(v, x):
            out, st = apply(v, x)   # the per-rank state, stacked [P, ...] over "tp" outside
            return out, jax.tree.map(lambda a: a[None], st)

        out_spec = (P("dp", "tp"), P("dp")) if isinstance(module, LinenMLP) else P("dp")
        run = jax.shard_map(per_rank, mesh=m, in_specs=(specs, P("dp")),
                            out_specs=(out_spec, P("tp", "dp")))
    else:
        run = apply

    def loss(v, x):
        out, st = run(v, x)
        y = out[-1] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(y)), (out, st)

    with jax.set_mesh(m):
        if grad:
            (_, (out, st)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
                variables, x)
        else:
            _, (out, st) = jax.jit(loss)(variables, x)
            g = None
    res = (out,) + ((st,) if state else ()) + ((g,) if grad else ())
    return res if len(res) > 1 else out


def dense_reference(params, x):
    """The unsharded LinenMLP (flax.linen.Dense) and its gradients."""
    ref = LinenMLP(dense=True)

    def loss(p, x):
        h, y = ref.apply({"params": p}, x)
        return jnp.sum(jnp.sin(y)), (h, y)

    (_, out), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, g


# --------------------------------------------------------------------------------------------
# Linen: parity with flax.linen.Dense


def test_linen_init_and_local_mode_are_dense():
    """No mesh, no axis: the layers initialize and compute as Dense (bit for bit), with any
    kernel_init / bias_init, dtype / param_dtype, with or without a bias; per-rank init inside
    shard_map gives each rank its slice of the same global parameters."""
    x = inputs()
    v = LinenMLP(CFG8).init(jax.random.key(0), x)
    params = nn.unbox(v["params"])
    ref = LinenMLP(dense=True).init(jax.random.key(0), x)["params"]
    assert bits_equal(params, ref)
    assert bits_equal(LinenMLP(CFG8).apply({"params": params}, x, mutable=["echo_state"])[0],
                      LinenMLP(dense=True).apply({"params": ref}, x))
    for kw in (dict(use_bias=False), dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
               dict(dtype=jnp.bfloat16)):
        for ours, theirs in ((ejnn.ColumnParallelDense(H, **kw), nn.Dense(H, **kw)),
                             (ejnn.RowParallelDense(H, **kw), nn.Dense(H, **kw))):
            p = ours.init(jax.random.key(3), x)
            q = theirs.init(jax.random.key(3), x)
            assert bits_equal(nn.unbox(p), q)
            y = ours.apply(p, x)
            assert y.dtype == theirs.apply(q, x).dtype and bits_equal(y, theirs.apply(q, x))
    # Per-rank init: the same global arrays as Dense's init with the same key (both under jit:
    # XLA fuses an initializer's arithmetic, so an eager init may differ in the last bit).
    ref = jax.jit(LinenMLP(dense=True).init)(jax.random.key(0), x)["params"]
    specs = nn.get_partition_spec(jax.eval_shape(LinenMLP().init, jax.random.key(0), x))
    init = jax.jit(jax.shard_map(lambda k, x: {"params": LinenMLP().init(k, x)["params"]},
                                 mesh=mesh(), in_specs=(P(), P("dp")),
                                 out_specs={"params": specs["params"]}))
    assert bits_equal(nn.unbox(init(jax.random.key(0), x)["params"]), ref)


@pytest.mark.parametrize("mode", MODES)
def test_linen_parity_with_dense(mode):
    x = inputs()
    v = LinenMLP().init(jax.random.key(0), x)
    params = {"params": v["params"]}
    (h_ref, y_ref), (g_ref, gx_ref) = dense_reference(nn.unbox(v["params"]), x)

    (h, y), (g, gx) = linen_run(LinenMLP(None), params, x, mode, grad=True)
    assert bits_equal(h, h_ref)                     # column-parallel: the same dot products
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)   # row: P partial sums
    assert max_rel((nn.unbox(g["params"]), gx), (g_ref, gx_ref)) < 1e-5

    (h8, y8), (g8, gx8) = linen_run(LinenMLP(CFG8), params, x, mode, grad=True)
    assert bits_equal(h8, h_ref)                    # the column site is identity forward
    assert max_rel(y8, y) < 0.02                    # one 8-bit all-reduce
    assert max_rel((nn.unbox(g8["params"]), gx8), (nn.unbox(g["params"]), gx)) < 0.05


# --------------------------------------------------------------------------------------------
# Linen: nn.scan over layers, remat, the state's flow


@pytest.mark.parametrize("mode", MODES)
def test_linen_scan_equals_unrolled(mode):
    """nn.scan (with remat, the carrier's collection as the loop carry) == the unrolled stack, bit
    for bit, with the early-8-bit policy (a tuple of configs, the layer index as `choice`); the
    unrolled stack with choices == the one with each layer's static config."""
    x = inputs()
    configs = tp.early_8bit_configs(CFG4)
    v = LinenStack(configs, scan=True).init(jax.random.key(0), x)
    scanned = {"params": v["params"]}
    unrolled = {"params": unstack(v["params"], 2)}
    y_s, st_s, (g_s, gx_s) = linen_run(LinenStack(configs, scan=True), scanned, x, mode,
                                       grad=True, state=True)
    y_u, st_u, (g_u, gx_u) = linen_run(LinenStack(configs), unrolled, x, mode, grad=True,
                                       state=True)
    assert bits_equal(y_s, y_u) and bits_equal(st_s, st_u) and bits_equal(gx_s, gx_u)
    assert bits_equal(unstack(g_s["params"], 2), g_u["params"])
    assert float(jnp.max(jnp.abs(st_s["echo"]["fwd"].m1))) > 0
    if mode == "shard_map":
        y_static = linen_run(LinenStack(None, configs=configs), unrolled, x, mode)
        assert bits_equal(y_static, y_u)
        y_4 = linen_run(LinenStack(CFG4), unrolled, x, mode)
        assert not bits_equal(y_4, y_u)                # the choice picked 8 bits for layer 0


@pytest.mark.parametrize("cfg", [CFG4, CFG4.replace(state_dtype="int8")], ids=["fp32", "int8"])
def test_linen_state_flows_as_echo_jax_tp(cfg):
    """Per rank: the layers' output, forward state and gradients are the bits of the same sites
    threaded by hand with echo_jax.tp (forward state through the sites, backward state through
    the cotangent); the state is nonzero after a pass and the next pass starts from zeros again;
    the gradients depend on the backward state (eta = 0 differs). With the int8 state too (the
    backward state's codes in the float carrier from the carrier's reset on)."""
    layers, m = 3, mesh()
    x = inputs()
    v = LinenStack(cfg, layers=layers).init(jax.random.key(0), x)
    variables = {"params": v["params"]}
    specs = nn.get_partition_spec(variables)

    def by_hand(v, x):
        p = jax.tree.map(lambda b: b.value, v["params"],  # no constraint on a manual axis
                         is_leaf=lambda b: isinstance(b, nn.Partitioned))
        fs = bs = ej.init_state(x, cfg, axis_name="tp")
        h = x
        for i in range(layers):
            q = p[f"layer{i}"]
            hin, bs = tp.backward_site(h, "tp", cfg, bs)
            u = nn.gelu(hin @ q["up"]["kernel"] + q["up"]["bias"])
            y, fs = tp.forward_site(u @ q["down"]["kernel"], "tp", cfg, fs)
            h = h + (y + q["down"]["bias"])
        return h, jax.tree.map(lambda a: a[None], fs)

    def layers_(model):
        def f(v, x):
            y, st = model.apply(v, x, mutable=["echo_state"])
            return y, jax.tree.map(lambda a: a[None], st["echo_state"]["echo"]["fwd"])
        return f

    def grads(f):
        run = jax.shard_map(f, mesh=m, in_specs=(specs, P("dp")),
                            out_specs=(P("dp"), P("tp", "dp")))

        def loss(v, x):
            y, fs = run(v, x)
            return jnp.sum(jnp.sin(y)), (y, fs)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(variables, x)

    (_, (y, fs)), g = grads(layers_(LinenStack(cfg, layers=layers, remat=False)))
    (_, (y_h, fs_h)), g_h = grads(by_hand)
    assert bits_equal(y, y_h) and bits_equal(fs, fs_h) and bits_equal(g, g_h)
    m1, m2 = (fs.m1.codes, fs.m2.codes) if cfg.state_dtype == "int8" else (fs.m1, fs.m2)
    assert float(jnp.max(jnp.abs(m1))) > 0 and float(jnp.max(jnp.abs(m2))) > 0
    (_, (_, _)), g_0 = grads(layers_(LinenStack(cfg.replace(eta=0.0), layers=layers,
                                                remat=False)))
    assert not bits_equal(g[1], g_0[1])


def test_linen_reset_per_pass_and_new_shapes():
    """The carrier resets at every pass: applying with the state a pass left (of another shape,
    as a KV-cache decoding step has) gives the fresh pass's output; the state follows x's shape;
    the state dtype is the config's."""
    cfg = CFG4.replace(state_dtype="bfloat16")
    model, m = LinenMLP(cfg), mesh()
    x = inputs(shape=(B, 3, D))
    v = model.init(jax.random.key(0), x)
    with jax.set_mesh(m):
        step = jax.jit(lambda v, x: model.apply(v, x, mutable=["echo_state"]))
        (_, y1), st1 = step({"params": v["params"]}, x)
        (_, y2), st2 = step({"params": v["params"], **st1}, x)
        (_, y3), st3 = step({"params": v["params"], **st2}, x[:, :1])
        (_, y4), _ = step({"params": v["params"]}, x[:, :1])
    fwd1, fwd3 = st1["echo_state"]["echo"]["fwd"], st3["echo_state"]["echo"]["fwd"]
    assert bits_equal(y1, y2) and bits_equal(y3, y4)
    assert fwd1.m1.shape == (4, B, 3, D) and fwd3.m1.shape == (4, B, 1, D)
    assert fwd1.m1.dtype == jnp.bfloat16 and float(jnp.max(jnp.abs(fwd1.m1))) > 0


def test_linen_vmap_simulation_is_shard_map():
    """`jax.vmap(..., axis_name="tp")` binds the axis too ("shard_map" mode, P ranks on one
    device): per-rank init and apply give the bits of the shard_map program on a ("tp",) mesh."""
    x, model = inputs(), LinenMLP(CFG4)
    ranks = dict(axis_name="tp", axis_size=4)
    v = jax.jit(jax.vmap(lambda k, x: {"params": model.init(k, x)["params"]},
                         in_axes=(None, None), **ranks))(jax.random.key(0), x)
    (h, y), _ = jax.jit(jax.vmap(lambda v, x: model.apply(v, x, mutable=["echo_state"]),
                                 in_axes=(0, None), **ranks))(v, x)
    m = make_mesh((4,), ("tp",))
    v1 = jax.jit(lambda k, x: {"params": model.init(k, x)["params"]})(jax.random.key(0), x)
    run = jax.jit(jax.shard_map(lambda v, x: model.apply(v, x, mutable=["echo_state"])[0],
                                mesh=m, in_specs=(nn.get_partition_spec(v1), P()),
                                out_specs=(P(None, "tp"), P())))
    h1, y1 = run(v1, x)
    assert bits_equal(jnp.concatenate(list(h), -1), h1) and bits_equal(y[0], y1)
    assert all(bits_equal(y[r], y[0]) for r in range(4))   # every rank the same bits


# --------------------------------------------------------------------------------------------
# NNX


class NNXMLP(nnx.Module):
    """x -> ColumnParallelLinear(D, H) -> gelu -> RowParallelLinear(H, D); returns (h, y)."""

    def __init__(self, config=None, *, linear=False, rngs):
        kw = dict(kernel_init=KINIT, bias_init=BINIT, precision=jax.lax.Precision.HIGHEST)
        if linear:
            self.echo = None
            self.up = nnx.Linear(D, H, rngs=rngs, **kw)
            self.down = nnx.Linear(H, D, rngs=rngs, **kw)
            return
        self.echo = ejnnx.EchoCarrier(config)
        self.up = ejnnx.ColumnParallelLinear(D, H, config=config, echo=self.echo, rngs=rngs,
                                             **kw)
        self.down = ejnnx.RowParallelLinear(H, D, config=config, echo=self.echo, rngs=rngs, **kw)

    def __call__(self, x):
        if self.echo is not None:
            self.echo.reset(x)
        h = self.up(x)
        return h, self.down(nnx.gelu(h))


class NNXBlock(nnx.Module):
    def __init__(self, config, *, rngs):
        self.config = config
        self.up = ejnnx.ColumnParallelLinear(D, H, config=config, rngs=rngs)
        self.down = ejnnx.RowParallelLinear(H, D, config=config, rngs=rngs)

    def __call__(self, x, echo, layer):
        choice = layer if isinstance(self.config, tuple) else None
        h = self.up(x, echo=echo, choice=choice)
        return x + self.down(nnx.gelu(h), echo=echo, choice=choice)


class NNXStack(nnx.Module):
    """L blocks: stacked (nnx.vmap at construction, nnx.scan in the call, the carrier in the
    carry) or a list; each block under nnx.remat (on both sides, as LinenStack)."""

    def __init__(self, config, layers=2, *, scan=False, rngs):
        self.echo = ejnnx.EchoCarrier(config)
        self.scan, self.layers = scan, layers
        if scan:
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def create(rngs):
                return NNXBlock(config, rngs=rngs)
            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([NNXBlock(config, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        self.echo.reset(x)
        if self.scan:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            @nnx.remat
            def body(carry, block, layer):
                h, echo = carry
                return block(h, echo, layer), echo

            x, _ = body((x, self.echo), self.blocks, jnp.arange(self.layers))
            return x
        for i, block in enumerate(self.blocks):
            x = nnx.remat(lambda b, h, echo, i: b(h, echo, i))(block, x, self.echo, jnp.int32(i))
        return x


def nnx_run(model, x, mode, *, grad=False):
    """model(x) in a mode: jit under jax.set_mesh, or per rank inside shard_map (nnx.split, the
    specs of nnx.get_partition_spec, nnx.merge). Returns (output, forward state, [grads of
    sum(sin(y)) w.r.t. (params, x)])."""
    m = mesh()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def call(params, rest, x):
        # copy=True: fresh Variables at this trace level (the carrier writes its state into them)
        mod = nnx.merge(graphdef, params, rest, copy=True)
        out = mod(x)
        return out, mod.echo.get("fwd")

    if mode == "shard_map":
        out_spec = (P("dp", "tp"), P("dp")) if isinstance(model, NNXMLP) else P("dp")

        def per_rank(params, rest, x):
            out, fs = call(params, rest, x)
            return out, jax.tree.map(lambda a: a[None], fs)

        run = jax.shard_map(per_rank, mesh=m,
                            in_specs=(nnx.get_partition_spec(params), P(), P("dp")),
                            out_specs=(out_spec, P("tp", "dp")))
    else:
        run = call

    def loss(params, x, rest):
        out, fs = run(params, rest, x)
        y = out[-1] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(y)), (out, fs)

    with jax.set_mesh(m):
        if grad:
            (_, (out, fs)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
                params, x, rest)
            return out, fs, g
        _, (out, fs) = jax.jit(loss)(params, x, rest)
    return out, fs


def nnx_model(cls, *args, mode="gspmd", **kw):
    """A model built under the mesh (its params sharded as created) for the gspmd runs, and
    without one (the metadata only) for shard_map; the same values either way."""
    if mode == "gspmd":
        with jax.set_mesh(mesh()):
            return cls(*args, **kw)
    return cls(*args, **kw)


def test_nnx_construction_and_local_mode_are_linear():
    x = inputs()
    ours = NNXMLP(CFG8, rngs=nnx.Rngs(0))
    ref = NNXMLP(linear=True, rngs=nnx.Rngs(0))
    assert bits_equal(nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param))
    assert bits_equal(ours(x), ref(x))
    assert ours.up.kernel.get_metadata()["out_sharding"] == (None, "tp")
    assert ours.down.kernel.get_metadata()["out_sharding"] == ("tp", None)
    for kw in (dict(use_bias=False), dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)):
        for cls in (ejnnx.ColumnParallelLinear, ejnnx.RowParallelLinear):
            a, b = cls(D, H, rngs=nnx.Rngs(2), **kw), nnx.Linear(D, H, rngs=nnx.Rngs(2), **kw)
            assert bits_equal(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))
            assert a(x).dtype == b(x).dtype and bits_equal(a(x), b(x))
    with jax.set_mesh(mesh()):
        sharded = NNXMLP(CFG8, rngs=nnx.Rngs(0))
    assert sharded.up.kernel[...].sharding.spec == P(None, "tp")
    assert bits_equal(nnx.state(sharded, nnx.Param), nnx.state(ref, nnx.Param))


@pytest.mark.parametrize("mode", MODES)
def test_nnx_parity_with_linear(mode):
    x = inputs()
    ref = NNXMLP(linear=True, rngs=nnx.Rngs(0))
    _, ref_params, ref_rest = nnx.split(ref, nnx.Param, ...)
    graphdef = nnx.graphdef(ref)

    def ref_loss(params, x):
        h, y = nnx.merge(graphdef, params, ref_rest)(x)
        return jnp.sum(jnp.sin(y)), (h, y)

    (_, (h_ref, y_ref)), g_ref = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)(
        ref_params, x)

    (h, y), fs, g = nnx_run(nnx_model(NNXMLP, None, mode=mode, rngs=nnx.Rngs(0)), x, mode,
                            grad=True)
    assert bits_equal(h, h_ref)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert max_rel(g, g_ref) < 1e-5

    (h8, y8), fs8, g8 = nnx_run(nnx_model(NNXMLP, CFG8, mode=mode, rngs=nnx.Rngs(0)), x, mode,
                                grad=True)
    assert bits_equal(h8, h_ref) and max_rel(y8, y) < 0.02 and max_rel(g8, g) < 0.05
    assert float(jnp.max(jnp.abs(fs8.m1))) > 0 and float(jnp.max(jnp.abs(fs.m1))) == 0


@pytest.mark.parametrize("mode", MODES)
def test_nnx_scan_equals_unrolled(mode):
    x = inputs()
    configs = tp.early_8bit_configs(CFG4)
    scanned = nnx_model(NNXStack, configs, scan=True, mode=mode, rngs=nnx.Rngs(0))
    unrolled = nnx_model(NNXStack, configs, scan=False, mode=mode, rngs=nnx.Rngs(0))
    for i in range(2):   # the unrolled blocks take the scanned stack's layer i
        for name in ("up", "down"):
            for p in ("kernel", "bias"):
                value = getattr(getattr(scanned.blocks, name), p)[...][i]
                getattr(getattr(unrolled.blocks[i], name), p)[...] = value
    y_s, fs_s, g_s = nnx_run(scanned, x, mode, grad=True)
    y_u, fs_u, g_u = nnx_run(unrolled, x, mode, grad=True)
    assert bits_equal(y_s, y_u) and bits_equal(fs_s, fs_u) and bits_equal(g_s[1], g_u[1])
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), nnx.to_pure_dict(g_u[0])["blocks"][0],
                           nnx.to_pure_dict(g_u[0])["blocks"][1])
    assert bits_equal(nnx.to_pure_dict(g_s[0])["blocks"], stacked)
    assert float(jnp.max(jnp.abs(fs_s.m1))) > 0


def test_nnx_state_resets_and_follows_shapes():
    """nnx.jit calls in a row: each pass resets the carrier (the same output as a fresh model's),
    a new sequence length makes a new state (Variable.set_value), in the config's dtype."""
    cfg = CFG4.replace(state_dtype="bfloat16")
    with jax.set_mesh(mesh()):
        model = NNXMLP(cfg, rngs=nnx.Rngs(0))
        fresh = NNXMLP(cfg, rngs=nnx.Rngs(0))
        step = nnx.jit(lambda m, x: m(x)[1])
        x = inputs(shape=(B, 3, D))
        y1 = step(model, x)
        assert model.echo.fwd.get_value().m1.shape == (4, B, 3, D)
        assert model.echo.fwd.get_value().m1.dtype == jnp.bfloat16
        y2 = step(model, x)
        y3 = step(model, x[:, :1])
        assert model.echo.fwd.get_value().m1.shape == (4, B, 1, D)
        assert bits_equal(y1, y2) and bits_equal(y3, step(fresh, x[:, :1]))
    assert float(jnp.max(jnp.abs(model.echo.fwd.get_value().m1.astype(jnp.float32)))) > 0
    assert nnx.state(model, ejnnx.EchoState)  # a Variable type of its own, for filters


# --------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_fix():
    x = inputs()

    class NoReset(nn.Module):
        @nn.compact
        def __call__(self, x):
            echo = ejnn.EchoCarrier(CFG4, name="echo")
            return ejnn.RowParallelDense(D, echo=echo)(x)

    with pytest.raises(ValueError, match="reset"):
        NoReset().init(jax.random.key(0), x)
    v = LinenMLP(CFG4).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="mutable"):
        LinenMLP(CFG4).apply({"params": v["params"]}, x)
    with pytest.raises(ValueError, match="mode"):
        ejnn.RowParallelDense(D, mode="manual").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="shard_map"):
        ejnn.RowParallelDense(D, mode="shard_map").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="EchoConfig"):
        ejnn.RowParallelDense(D, config=4).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="mode"):
        ejnnx.RowParallelLinear(D, D, mode="bad", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="state_dtype"):
        ejnnx.EchoCarrier((CFG4, CFG4.replace(state_dtype="bfloat16")))
    model = NNXMLP(CFG4, rngs=nnx.Rngs(0))
    model.echo.reset(inputs(shape=(2, D)))   # a state of another shape than the sites'
    with pytest.raises(ValueError, match="Reset the carrier"):
        model.up(x)
    # Per rank, a kernel that is not this rank's block: the message names the specs.
    graphdef, state = nnx.split(NNXMLP(None, rngs=nnx.Rngs(0)))
    bad = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x)[1], mesh=mesh(),
                        in_specs=(P(), P("dp")), out_specs=P("dp"))
    with pytest.raises(ValueError, match="get_partition_spec"):
        bad(state, x)


# --------------------------------------------------------------------------------------------
# docs/your_model.md


def doc_blocks():
    """The ```python blocks of docs/your_model.md marked "# runs as a test", each padded with
    blank lines so that a traceback names the page's own line numbers."""
    text = DOC.read_text(encoding="utf-8")
    return [("\n" * text[:m.start(1)].count("\n") + m.group(1), m.group(1).split("\n", 1)[0])
            for m in re.finditer(r"```python\n(.*?)```", text, re.S)
            if m.group(1).startswith("# runs as a test")]


def test_doc_has_the_five_examples():
    heads = [h for _, h in doc_blocks()]
    assert len(heads) == 5, heads


@pytest.mark.parametrize("index", range(5))
def test_doc_example_runs(index):
    code, _ = doc_blocks()[index]
    namespace = {"__name__": f"your_model_md_example_{index}"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ej.EchoShardingWarning)
        exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102
    assert namespace["CHECKED"] is True


# --------------------------------------------------------------------------------------------
# slow: more meshes


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((8,), ("tp",)), ((2, 4), ("fsdp", "tp"))])
def test_linen_and_nnx_on_other_meshes(shape, names):
    """The exact mode equals Dense / Linear on a tp-only mesh and on ("fsdp", "tp") (the batch
    over "fsdp"), both modes. The column layer to rounding here: on 8 ranks a rank's block has
    16 columns, and XLA:CPU's dot of x [8, 64] with 16 columns adds in another order than with
    128 (measured: up to 6e-7 apart; 32 or more columns give the same bits)."""
    m = make_mesh(shape, names)
    batch = names[0] if len(names) == 2 else None
    x = inputs()
    v = LinenMLP().init(jax.random.key(0), x)
    (h_ref, y_ref), _ = dense_reference(nn.unbox(v["params"]), x)
    specs = nn.get_partition_spec({"params": v["params"]})
    with jax.set_mesh(m):
        h, y = jax.jit(lambda v, x: LinenMLP().apply(v, x, mutable=["echo_state"])[0])(
            {"params": v["params"]}, x)
        np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        run = jax.jit(jax.shard_map(
            lambda v, x: LinenMLP(CFG8).apply(v, x, mutable=["echo_state"])[0], mesh=m,
            in_specs=(specs, P(batch)), out_specs=(P(batch, "tp"), P(batch))))
        h8, y8 = run({"params": v["params"]}, x)
        assert bits_equal(h8, h) and max_rel(y8, y_ref) < 0.02
        model = NNXMLP(CFG8, rngs=nnx.Rngs(0))
        _, y8n = nnx.jit(lambda m, x: m(x))(model, x)
    _, y_linear = NNXMLP(linear=True, rngs=nnx.Rngs(0))(x)
    assert max_rel(y8n, y_linear) < 0.02
