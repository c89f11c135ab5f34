"""Echo inside jit programs whose arrays carry shardings (`echo_jax.gspmd`, docs/jit.md).

Each replaced site is checked on the compiled HLO: the Echo custom call is there (the CPU one on
the fake devices, transport "auto") and no all-reduce, all-gather, all-to-all or reduce-scatter
carries an activation (only scalars and weight-shaped arrays: the data-parallel weight gradient
and the FSDP gathers). Numerics: the exact mode (config=None) equals the unsharded model to fp32
rounding, gradients included; 8 bits stays within a loose bound of it.

Run as a script (`python tests/echo_jax/test_gspmd.py`) it prints the before / after table of
collectives per site for a 2-layer transformer block stack on a ("dp", "tp") = (2, 4) mesh.
"""

import os

if __name__ == "__main__":  # as a script: the 8 fake devices before JAX starts (pytest: conftest)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import re  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import echo_jax as ej  # noqa: E402
from echo_jax import gspmd, tp  # noqa: E402
from echo_jax.gspmd import EchoShardingWarning  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "jit.md"
B, K, N = 24, 64, 128          # batch, model dim, hidden dim: no activation shape is weight-shaped
CFG8 = ej.EchoConfig(bits=8)
MESHES = {"tp": ((8,), ("tp",)), "dp_tp": ((2, 4), ("dp", "tp")),
          "fsdp_tp": ((2, 4), ("fsdp", "tp"))}


def mesh_of(kind, explicit=False):
    shape, names = MESHES[kind]
    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names, axis_types=types)


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Both partitioners of the installed JAX (Shardy is the default; GSPMD by the flag)."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    try:
        yield request.param
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (B, K))
    w1 = jax.random.normal(k[1], (K, N)) / 8      # column-parallel
    w2 = jax.random.normal(k[2], (N, K)) / 11     # row-parallel
    return x, w1, w2


def layouts(kind):
    """(x, w1, w2) PartitionSpecs of the MLP on a mesh kind (FSDP: the weights over "fsdp")."""
    batch = {"tp": None, "dp_tp": "dp", "fsdp_tp": "fsdp"}[kind]
    if kind == "fsdp_tp":
        return P(batch, None), P("fsdp", "tp"), P("tp", "fsdp")
    return P(batch, None), P(None, "tp"), P("tp", None)


def reference(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def mlp(config, kind, explicit):
    """The MLP through the helpers: Auto axes pass the FSDP weight layout as w_spec (a traced
    array carries none); Explicit axes read every layout from the types."""
    _, s1, s2 = layouts(kind)
    kw1 = {} if explicit or kind != "fsdp_tp" else dict(w_spec=s1)
    kw2 = {} if explicit or kind != "fsdp_tp" else dict(w_spec=s2)

    def f(x, w1, w2):
        h = gspmd.column_parallel_matmul(x, w1, config=config, **kw1)
        return gspmd.row_parallel_matmul(jnp.tanh(h), w2, config=config, **kw2)
    return f


def placed(mesh, kind, arrays):
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays,
                                                                           layouts(kind)))


def padded(spec, ndim):
    """A PartitionSpec as a tuple of ndim entries (JAX may drop or keep trailing Nones)."""
    return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def weight_shapes(*shapes):
    """Every shard shape of the given weights (dims divided by 1, 2, 4, 8) and the scalar."""
    out = {()}
    for a, b in shapes:
        out |= {(a // i, b // j) for i in (1, 2, 4, 8) for j in (1, 2, 4, 8)}
    return out


def activation_collectives(text, allowed):
    """The data-moving collectives of a compiled program whose shapes are not all allowed."""
    return [op for op in gspmd.collective_ops(text)
            if op["op"] in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
                            "collective-permute")
            and not all(dims in allowed for _, dims in op["shapes"])]


def echo_calls(text):
    return [op for op in gspmd.collective_ops(text) if op["op"] == "echo"]


# --------------------------------------------------------------------------------------------
# the two sites: HLO and numerics


def check_mlp(kind, explicit, lowered_has_sdy=None):
    mesh = mesh_of(kind, explicit)
    x, w1, w2 = params()
    ref = reference(x, w1, w2)
    ref_g = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a))), argnums=(0, 1, 2))(x, w1, w2)
    allowed = weight_shapes((K, N), (N, K))
    with jax.set_mesh(mesh):
        args = placed(mesh, kind, (x, w1, w2))
        for config in (None, CFG8):
            f = mlp(config, kind, explicit)
            loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
            fwd, grad = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            if lowered_has_sdy is not None:
                assert ("sdy." in fwd.lower(*args).as_text()) == lowered_has_sdy
            y, g = fwd(*args), grad(*args)
            tf, tg = fwd.lower(*args).compile().as_text(), grad.lower(*args).compile().as_text()
            assert y.shape == (B, K) and y.sharding.spec[0] == layouts(kind)[0][0]
            if config is None:
                np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
                for a, b in zip(g, ref_g):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                               atol=1e-5)
                # XLA's exact all-reduce of the row site, one per pass direction: the baseline
                ar = [op for op in gspmd.collective_ops(tf) if op["op"] == "all-reduce"]
                assert len(ar) == 1 and not echo_calls(tf)
                continue
            # Echo: the CPU custom call at the row site (forward) and at the column site
            # (backward), and no collective that carries an activation.
            assert [op["target"] for op in echo_calls(tf)] == ["echo_allreduce_cpu"]
            assert len(echo_calls(tg)) == 2
            assert not activation_collectives(tf, allowed), gspmd.collective_ops(tf)
            assert not activation_collectives(tg, allowed), gspmd.collective_ops(tg)
            # Measured: 0.023 max abs (|y| up to about 4), gradients 0.9 % relative at most.
            assert float(jnp.max(jnp.abs(y - ref))) < 0.1
            for a, b in zip(g, ref_g):
                assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 0.03


@pytest.mark.parametrize("kind", list(MESHES))
def test_sites_replace_the_all_reduce(kind, partitioner):
    check_mlp(kind, explicit=False, lowered_has_sdy=partitioner == "shardy")


@pytest.mark.parametrize("kind", ["dp_tp", "fsdp_tp"])
def test_sites_read_explicit_shardings(kind):
    check_mlp(kind, explicit=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MESHES))
def test_sites_explicit_gspmd_partitioner(kind):
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        check_mlp(kind, explicit=True, lowered_has_sdy=False)
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def test_fsdp_gathers_the_weight_not_the_activation():
    mesh = mesh_of("fsdp_tp")
    x, w1, w2 = params()
    with jax.set_mesh(mesh):
        args = placed(mesh, "fsdp_tp", (x, w1, w2))
        text = jax.jit(mlp(CFG8, "fsdp_tp", False)).lower(*args).compile().as_text()
    gathers = [op for op in gspmd.collective_ops(text) if op["op"] == "all-gather"]
    # w1's local [K / 2, N / 4] block to [K, N / 4]; w2's [N / 4, K / 2] to [N / 4, K]
    assert sorted(dims for op in gathers for _, dims in op["shapes"]) == \
        sorted([(K, N // 4), (N // 4, K)])


# --------------------------------------------------------------------------------------------
# the compensator state


def test_state_for_layout():
    mesh = mesh_of("dp_tp")
    with jax.set_mesh(mesh):
        s = gspmd.state_for((B, N), config=CFG8)
        assert s.m1.shape == (4, B, N) and s.m1.dtype == jnp.float32
        assert padded(s.m1.sharding.spec, 3) == ("tp", "dp", None)
        s16 = gspmd.state_for(jax.ShapeDtypeStruct((B, 3, N), jnp.bfloat16),
                              config=CFG8.replace(state_dtype="bfloat16"))
        assert s16.m1.shape == (4, B, 3, N) and s16.m1.dtype == jnp.bfloat16
        assert padded(s16.m1.sharding.spec, 4) == ("tp", "dp", None, None)
        with pytest.raises(ValueError, match="replicated over 'tp'"):
            gspmd.state_for((B, N), spec=P(None, "tp"))
        with pytest.raises(ValueError, match="does not divide"):
            gspmd.state_for((3, N))
    emesh = mesh_of("dp_tp", explicit=True)
    with jax.set_mesh(emesh):
        y = jax.device_put(jnp.zeros((B, N)), P("dp", None))
        s = jax.jit(lambda y: gspmd.state_for(y))(y)
        assert padded(jax.typeof(s.m2).sharding.spec, 3) == ("tp", "dp", None)


def test_compensated_row_site_equals_hand_written_shard_map():
    """The helper is the fully manual shard_map a user would write, bit for bit, and its
    state is the per-rank state of that program stacked over "tp"."""
    mesh = mesh_of("dp_tp")
    x, w1, w2 = params(1)
    h = jnp.tanh(x @ w1)
    cfg = ej.EchoConfig(bits=4)

    def by_hand(h, w2, m1, m2):
        def body(hl, wl, m1, m2):
            y, s = tp.forward_site(hl @ wl, "tp", cfg, ej.CompensatorState(m1[0], m2[0]))
            return y, s.m1[None], s.m2[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None),
                                                        P("tp", "dp"), P("tp", "dp")),
                             out_specs=(P("dp", None), P("tp", "dp"), P("tp", "dp")))(
            h, w2, m1, m2)

    with jax.set_mesh(mesh):
        state = gspmd.state_for((B, K), config=cfg)

        def two_steps(h, w2, state):
            y1, s = gspmd.row_parallel_matmul(h, w2, config=cfg, state=state)
            y2, s = gspmd.row_parallel_matmul(h * 0.5, w2, config=cfg, state=s)
            return y1, y2, s

        f = jax.jit(two_steps)
        y1, y2, s = f(h, w2, state)
        text = f.lower(h, w2, state).compile().as_text()
        r1, m1, m2 = jax.jit(by_hand)(h, w2, state.m1, state.m2)
        r2, m1, m2 = jax.jit(by_hand)(h * 0.5, w2, m1, m2)
    assert [op["target"] for op in echo_calls(text)] == ["echo_allreduce_comp_cpu"] * 2
    assert not activation_collectives(text, weight_shapes((N, K)))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(r1))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(r2))
    np.testing.assert_array_equal(np.asarray(s.m1), np.asarray(m1))
    assert s.m1.shape == (4, B, K) and padded(s.m1.sharding.spec, 3) == ("tp", "dp", None)
    assert float(jnp.max(jnp.abs(s.m1))) > 0  # the state was updated


def test_column_site_backward_state_is_the_cotangent():
    mesh = mesh_of("dp_tp")
    x, w1, _ = params(2)
    cfg = ej.EchoConfig(bits=4)
    with jax.set_mesh(mesh):
        bstate = gspmd.state_for((B, K), config=cfg)

        def loss(x, w1, bs):
            h, bs = gspmd.column_parallel_matmul(x, w1, config=cfg, state=bs)
            h2, _ = gspmd.column_parallel_matmul(x * 0.5 + h[:, :K] * 0, w1, config=cfg,
                                                 state=bs)
            return jnp.sum(jnp.sin(h + h2))

        f = jax.jit(jax.grad(loss, argnums=(0, 2)))
        gx, new = f(x, w1, bstate)
        text = f.lower(x, w1, bstate).compile().as_text()
        gx_exact = jax.jit(jax.grad(lambda x, w1: jnp.sum(jnp.sin(x @ w1 + (x * 0.5) @ w1))))(
            x, w1)
    assert [op["target"] for op in echo_calls(text)] == ["echo_allreduce_comp_cpu"] * 2
    assert new.m1.shape == (4, B, K) and float(jnp.max(jnp.abs(new.m1))) > 0
    assert float(jnp.max(jnp.abs(gx - gx_exact)) / jnp.max(jnp.abs(gx_exact))) < 0.2


# --------------------------------------------------------------------------------------------
# scan over layers, remat


def test_scan_remat_stack():
    mesh = mesh_of("dp_tp")
    layers = 2
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (B, K))
    w1 = jax.random.normal(k[1], (layers, K, N)) / 8
    w2 = jax.random.normal(k[2], (layers, N, K)) / 11

    def stack(config, x, w1, w2, fstate, bstate):
        @jax.checkpoint
        def layer(carry, w):
            h, fs, bs = carry
            u, bs = gspmd.column_parallel_matmul(h, w[0], config=config, state=bs)
            y, fs = gspmd.row_parallel_matmul(jnp.tanh(u), w[1], config=config, state=fs)
            return (h + y, fs, bs), None
        (h, fs, bs), _ = lax.scan(layer, (x, fstate, bstate), (w1, w2))
        return jnp.sum(jnp.sin(h)), fs

    def ref_loss(x, w1, w2):
        h = x
        for i in range(layers):
            h = h + jnp.tanh(h @ w1[i]) @ w2[i]
        return jnp.sum(jnp.sin(h))

    ref_g = jax.grad(ref_loss, argnums=(0, 1, 2))(x, w1, w2)
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, P("dp", None)), jax.device_put(w1, P(None, None, "tp")),
                jax.device_put(w2, P(None, "tp", None)))
        for config in (None, ej.EchoConfig(bits=8)):
            fs, bs = gspmd.state_for((B, K), config=config), gspmd.state_for((B, K))
            f = jax.jit(jax.grad(lambda *a: stack(config, *a)[0], argnums=(0, 1, 2, 4)))
            *g, new_bs = f(*args, fs, bs)
            tol = (1e-4, 1e-5) if config is None else None
            for a, b in zip(g, ref_g):
                if tol:
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol[0],
                                               atol=tol[1])
                else:
                    assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 0.03
            if config is not None:
                text = f.lower(*args, fs, bs).compile().as_text()
                calls = echo_calls(text)
                assert calls and {c["target"] for c in calls} == {"echo_allreduce_comp_cpu"}
                assert not activation_collectives(text, weight_shapes((K, N), (N, K)))
                assert float(jnp.max(jnp.abs(new_bs.m1))) > 0


# --------------------------------------------------------------------------------------------
# fallback and the partial-manual warning


def test_fallback_warns_and_runs_the_plain_dot():
    mesh = mesh_of("dp_tp", explicit=True)
    x, w1, w2 = params()
    h = jnp.tanh(x @ w1)
    with jax.set_mesh(mesh):
        hs = jax.device_put(h, P("dp", None))            # the contraction dim is whole
        ws = jax.device_put(w2, P(None, None))
        with pytest.warns(EchoShardingWarning, match="not sharded over 'tp'.*plain jnp.dot"):
            f = jax.jit(lambda h, w: gspmd.row_parallel_matmul(h, w, config=CFG8))
            y = f(hs, ws)
        text = f.lower(hs, ws).compile().as_text()
        with pytest.warns(EchoShardingWarning, match="output dim"):
            gspmd.column_parallel_matmul(jax.device_put(x, P("dp", None)),
                                         jax.device_put(w1, P(None, None)), config=CFG8)
        with pytest.warns(EchoShardingWarning, match="major entry"):
            gspmd.row_parallel_matmul(x, w1, config=CFG8, mesh=mesh_of("fsdp_tp"),
                                      x_spec=P("fsdp", "tp"), w_spec=P(("fsdp", "tp"), None))
    np.testing.assert_allclose(np.asarray(y), np.asarray(h @ w2), rtol=1e-5, atol=1e-5)
    assert not echo_calls(text)


def test_axes_of_size_one():
    """A size-1 batch axis is left alone (the shard_map still takes it); a size-1 "tp" has
    nothing to reduce: the plain dot, without a warning."""
    x, w1, w2 = params()
    h = jnp.tanh(x @ w1)
    devices = np.array(jax.devices()[:4])
    for shape, calls in (((1, 4), 1), ((4, 1), 0)):
        mesh = jax.sharding.Mesh(devices.reshape(shape), ("dp", "tp"),
                                 axis_types=(AxisType.Auto,) * 2)
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("error", EchoShardingWarning)
            f = jax.jit(lambda h, w: gspmd.row_parallel_matmul(h, w, config=CFG8))
            y = f(h, w2)
            assert len(echo_calls(f.lower(h, w2).compile().as_text())) == calls
        assert float(jnp.max(jnp.abs(y - h @ w2))) < 0.1


def test_errors_name_the_fix():
    mesh = mesh_of("dp_tp")
    x, w1, w2 = params()
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="does not divide"):
            gspmd.row_parallel_matmul(x[:3] @ w1, w2, config=CFG8)
        with pytest.raises(ValueError, match="state_for"):
            gspmd.row_parallel_matmul(x @ w1, w2, config=CFG8, state=(1, 2))
        with pytest.raises(ValueError, match="x's last dim must match"):
            gspmd.row_parallel_matmul(x, w2)
    with pytest.raises(ValueError, match="no mesh"):
        jax.jit(lambda x, w: gspmd.row_parallel_matmul(x, w))(x @ w1, w2)


def test_partial_manual_shard_map_warns():
    """echo_psum in a shard_map manual over "tp" alone on a ("dp", "tp") mesh: XLA gathers the
    contribution across "dp" (the HLO shows it) and echo_psum says so; a fully manual one and
    vmap stay quiet."""
    mesh = mesh_of("dp_tp")
    x, w1, w2 = params()
    h = jnp.tanh(x @ w1)

    def partial(h, w):
        return jax.shard_map(lambda hl, wl: ej.echo_psum(hl @ wl, "tp", config=CFG8),
                             mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                             out_specs=P(), axis_names={"tp"})(h, w)

    hs = jax.device_put(h, NamedSharding(mesh, P("dp", "tp")))
    with pytest.warns(EchoShardingWarning, match=r"'dp' of size 2.*axis_names"):
        text = jax.jit(partial, out_shardings=NamedSharding(mesh, P("dp", None))).lower(
            hs, w2).compile().as_text()
    assert not echo_calls(text)   # "auto" ran "xla": the custom call cannot run there
    assert activation_collectives(text, weight_shapes((N, K)))  # the gather behind its back
    assert gspmd.auto_axes_beside("tp") == ()  # outside any shard_map

    def full(h, w):
        return jax.shard_map(lambda hl, wl: ej.echo_psum(hl @ wl, "tp", config=CFG8),
                             mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                             out_specs=P("dp", None))(h, w)

    with warnings.catch_warnings():
        warnings.simplefilter("error", EchoShardingWarning)
        jax.jit(full).lower(hs, w2)
        jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=CFG8), axis_name="tp")).lower(
            jnp.ones((4, 256)))


# --------------------------------------------------------------------------------------------
# the HLO reader and the doc


def test_collective_ops_reads_hlo_lines():
    text = "\n".join([
        '  %all-reduce.1 = f32[8,256]{1,0} all-reduce(%x), channel_id=1, '
        'replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add',
        '  %ag = (bf16[4,16]{1,0}, u8[4,16]{1,0}) all-gather-start(bf16[1,16]{1,0} %a), '
        'replica_groups={{0,1,2,3}}, dimensions={0}',
        '  %ffi = f32[2048]{0} custom-call(%b, %c), custom_call_target="echo_allreduce_cpu"',
        '  %other = f32[4]{0} custom-call(%b), custom_call_target="something_else"',
        '  %add.3 = f32[8,256]{1,0} add(%p, %q)'])
    ops = gspmd.collective_ops(text)
    assert [o["op"] for o in ops] == ["all-reduce", "all-gather", "echo"]
    assert ops[0]["bytes"] == 8 * 256 * 4 and ops[0]["groups"] == "[2,4]<=[8]"
    assert ops[1]["shapes"] == [("u8", (4, 16))] and ops[1]["bytes"] == 64
    assert ops[2]["target"] == "echo_allreduce_cpu" and ops[2]["bytes"] == 8192


def doc_example() -> str:
    """The ```python block of docs/jit.md marked "# runs as a test", padded with blank lines so
    that a traceback names the doc's own line numbers."""
    text = DOC.read_text(encoding="utf-8")
    blocks = [m for m in re.finditer(r"```python\n(.*?)```", text, re.S)
              if "# runs as a test" in m.group(1)]
    assert len(blocks) == 1, "docs/jit.md must have one ```python block marked '# runs as a test'"
    return "\n" * text[:blocks[0].start(1)].count("\n") + blocks[0].group(1)


def test_doc_example_runs():
    namespace = {"__name__": "jit_md_example"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", EchoShardingWarning)
        exec(compile(doc_example(), str(DOC), "exec"), namespace)  # noqa: S102
    assert namespace["CHECKED"] is True


# --------------------------------------------------------------------------------------------
# before / after: collectives per site of a 2-layer transformer on ("dp", "tp") = (2, 4)

D, HEADS, S, BT, F = 64, 8, 16, 8, 256   # model dim, heads, sequence, batch, MLP hidden


def transformer(sites, cfg):
    """loss(params, x) of a 2-layer pre-norm transformer (attention + MLP) whose four matmuls a
    layer go through `sites` (column, row): plain jnp.dot or the helpers."""
    column, row = sites

    def norm(h):
        return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

    def layer(h, p):
        a = norm(h)
        qkv = column(a, p["wqkv"], cfg).reshape(BT, S, HEADS, 3, D // HEADS)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        att = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // HEADS), -1)
        o = jnp.einsum("bhst,bthd->bshd", att, v).reshape(BT, S, D)
        h = h + row(o, p["wo"], cfg)
        u = jax.nn.gelu(column(norm(h), p["w1"], cfg))
        return h + row(u, p["w2"], cfg)

    def loss(params, x):
        h = x
        for p in params:
            h = layer(h, p)
        return jnp.mean(h ** 2)
    return loss


def plain_sites():
    return (lambda x, w, cfg: jnp.dot(x, w), lambda x, w, cfg: jnp.dot(x, w))


def echo_sites():
    return (lambda x, w, cfg: gspmd.column_parallel_matmul(x, w, config=cfg),
            lambda x, w, cfg: gspmd.row_parallel_matmul(x, w, config=cfg))


def transformer_params(mesh):
    k = jax.random.split(jax.random.key(7), 8)
    specs = dict(wqkv=P(None, "tp"), wo=P("tp", None), w1=P(None, "tp"), w2=P("tp", None))
    shapes = dict(wqkv=(D, 3 * D), wo=(D, D), w1=(D, F), w2=(F, D))
    params = []
    for i in range(2):
        params.append({n: jax.device_put(jax.random.normal(k[4 * i + j], shapes[n])
                                         / np.sqrt(shapes[n][0]), NamedSharding(mesh, specs[n]))
                       for j, n in enumerate(specs)})
    x = jax.device_put(jax.random.normal(k[-1], (BT, S, D)), NamedSharding(mesh, P("dp")))
    return params, x


def site_table(cfg=None):
    """Rows (program, op, target, shapes, bytes, ranks, wire bytes a rank sends, groups) of the
    compiled training step (the loss and its gradients with respect to the parameters and the
    input, as an embedding below it would need) of the 2-layer transformer on ("dp", "tp") =
    (2, 4): BEFORE with plain jnp.dot (XLA inserts the all-reduces), AFTER with the helpers
    (Echo, 4 bits unless cfg)."""
    cfg = ej.EchoConfig(bits=4) if cfg is None else cfg
    mesh = mesh_of("dp_tp")
    rows = []
    with jax.set_mesh(mesh):
        params, x = transformer_params(mesh)
        for name, sites in (("before", plain_sites()), ("after", echo_sites())):
            step = jax.jit(jax.value_and_grad(transformer(sites, cfg), argnums=(0, 1)))
            text = step.lower(params, x).compile().as_text()
            for op in gspmd.collective_ops(text):
                rows.append((name, op["op"], op["target"],
                             " ".join(f"{dt}{list(d)}".replace(" ", "") for dt, d in op["shapes"]),
                             op["bytes"], op["ranks"], op["wire_bytes"], op["groups"]))
    return rows


def print_site_table(rows):
    print(f"{'program':8} {'op':10} {'target':19} {'shapes':16} {'bytes':>7} {'ranks':>5} "
          f"{'wire/rank':>9}  groups")
    for r in rows:
        shapes = r[3] if len(r[3]) <= 16 else f"{len(r[3].split())} arrays"
        print(f"{r[0]:8} {r[1]:10} {r[2]:19} {shapes:16} {r[4]:>7} {r[5]:>5} {r[6]:>9.0f}  "
              f"{r[7]}")


@pytest.mark.slow
def test_transformer_site_table():
    rows = site_table()
    act = (BT // 2) * S * D * 4   # one rank's fp32 activation [4, 16, 64]
    before = [r for r in rows if r[0] == "before"]
    after = [r for r in rows if r[0] == "after"]
    # before: XLA's own all-reduce at each of the 8 sites (4 row forward, 4 column backward)
    assert len([r for r in before if r[1] == "all-reduce" and r[4] == act]) == 8
    # after: 8 Echo calls of the same contribution, and no activation-sized collective left
    assert len([r for r in after if r[1] == "echo" and r[4] == act]) == 8
    assert not [r for r in after if r[1] != "echo" and r[5] == 4 and r[4] > 4]  # tp: scalars
    # the 4-bit wire: about 4.25 / 32 of the ring all-reduce's bytes a rank sends
    ring = [r[6] for r in before if r[1] == "all-reduce" and r[4] == act][0]
    echo = [r[6] for r in after if r[1] == "echo"][0]
    assert 0.12 < echo / ring < 0.15
    print_site_table(rows)


if __name__ == "__main__":
    print_site_table(site_table())
