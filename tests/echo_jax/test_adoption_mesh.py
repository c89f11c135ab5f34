"""Echo in a user's model without surprises: the mesh context and the meaning of config=None.

What a Flax / JAX user does when adding Echo to an existing training script, on the 8 fake CPU
devices with a ("dp", "tp") = (2, 4) mesh, one case per route. Each route either works or says
what to do, by a warning that a filter turns into an error or by an exception whose message
names the fix:

1. a layer with an `EchoCarrier` called eagerly, its kernel a concrete sharded array, without
   `jax.set_mesh`: a `ValueError` naming `jax.set_mesh` (not an AttributeError), and the same
   call under `jax.set_mesh` runs;
2. a model built under `jax.set_mesh`, its step jitted (`nnx.jit` / `jax.jit`) outside it: an
   `ej.EchoMeshWarning` naming `with jax.set_mesh(mesh):` (an error under
   `-W error::echo_jax.EchoShardingWarning`), and under `jax.set_mesh` the compiled step has its
   Echo calls (counted as the fast-path checklist of docs/your_model.md counts them);
3. `ej.row_parallel_matmul(..., state=ej.init_state(x))`: a `ValueError` naming
   `echo_jax.gspmd.state_for` and the call;
4. `config=None`: the exact `lax.psum` in the layers, the tp sites and the GSPMD helpers;
   `echo_psum(x, axis)` without a config is 4-bit Echo; `echo_psum(..., config=None)` warns
   (`FutureWarning`) that it is to mean the exact sum.
"""

import re
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import echo_jax as ej
from echo_jax import tp
from echo_jax.flax import linen as ejnn
from echo_jax.flax import nnx as ejnnx
from conftest import make_mesh

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_model.md"
B, D, H = 8, 64, 128
CFG = ej.EchoConfig(bits=4)


def mesh():
    return make_mesh((2, 4), ("dp", "tp"))


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def inputs(seed=1, shape=(B, D)):
    return jax.random.normal(jax.random.key(seed), shape)


class MLP(nnx.Module):
    """A user's NNX block: Column -> gelu -> Row, one carrier reset per pass."""

    def __init__(self, config, *, rngs):
        self.echo = ejnnx.EchoCarrier(config)
        self.up = ejnnx.ColumnParallelLinear(D, H, config=config, echo=self.echo, rngs=rngs)
        self.down = ejnnx.RowParallelLinear(H, D, config=config, echo=self.echo, rngs=rngs)

    def __call__(self, x):
        self.echo.reset(x)
        return self.down(nnx.gelu(self.up(x)))


def built_under_mesh(m, config=CFG):
    with jax.set_mesh(m):
        return MLP(config, rngs=nnx.Rngs(0))


def echo_calls(compiled_text):
    """The fast-path checklist's count (docs/your_model.md) of a compiled step's Echo calls."""
    return len(re.findall(r'custom_call_target="echo_allreduce', compiled_text))


# --------------------------------------------------------------------------------------------
# 1. eager, a carrier, a kernel with a concrete NamedSharding, no jax.set_mesh


def test_row1_eager_with_carrier_names_set_mesh():
    m = mesh()
    model = built_under_mesh(m)
    assert isinstance(model.up.kernel[...].sharding, NamedSharding)   # the user's setup
    x = inputs()
    with pytest.raises(ValueError, match=r"with jax\.set_mesh\(mesh\):"):
        model(x)
    with jax.set_mesh(m):                                              # the fix works
        y = model(x)
    exact = built_under_mesh(m, None)
    with jax.set_mesh(m):
        y_exact = exact(x)
    assert y.shape == (B, D) and rel_err(y, y_exact) < 0.2


def test_row1_eager_without_carrier_still_runs():
    m = mesh()
    with jax.set_mesh(m):
        layer = ejnnx.RowParallelLinear(H, D, config=CFG, rngs=nnx.Rngs(0))
        exact = ejnnx.RowParallelLinear(H, D, config=None, rngs=nnx.Rngs(0))
    x = inputs(shape=(B, H))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ej.EchoShardingWarning)
        y = layer(x)
    assert rel_err(y, exact(x)) < 0.2


# --------------------------------------------------------------------------------------------
# 2. built under jax.set_mesh, the step jitted outside it


def test_row2_jit_outside_set_mesh_warns_with_the_fix():
    m = mesh()
    model = built_under_mesh(m)
    x = inputs()

    @nnx.jit
    def step(model, x):
        return model(x)

    with pytest.warns(ej.EchoMeshWarning, match=r"with jax\.set_mesh\(mesh\):"):
        step(model, x)
    assert issubclass(ej.EchoMeshWarning, ej.EchoShardingWarning)

    # Turned into an error, as in CI.
    @nnx.jit
    def step2(model, x):
        return model(x) * 1.0

    with warnings.catch_warnings():
        warnings.simplefilter("error", ej.EchoShardingWarning)
        with pytest.raises(ej.EchoMeshWarning):
            step2(model, x)


def test_row2_linen_jax_jit_outside_set_mesh_warns():
    m = mesh()

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            echo = ejnn.EchoCarrier(CFG, name="echo")
            echo.reset(x)
            h = ejnn.ColumnParallelDense(H, config=CFG, echo=echo)(x)
            return ejnn.RowParallelDense(D, config=CFG, echo=echo)(nn.gelu(h))

    x = inputs()
    model = LinenMLP()
    with jax.set_mesh(m):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        shardings = nn.get_sharding(abstract, m)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    apply = jax.jit(lambda v, x: model.apply(v, x, mutable=["echo_state"])[0])
    with pytest.warns(ej.EchoMeshWarning, match=r"with jax\.set_mesh\(mesh\):"):
        apply(variables, x)


def test_row2_under_set_mesh_the_compiled_step_has_echo_calls():
    m = mesh()
    model = built_under_mesh(m)
    graphdef, state = nnx.split(model)
    x = inputs()

    def step(state, x):
        return nnx.merge(graphdef, state, copy=True)(x)

    with jax.set_mesh(m):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ej.EchoShardingWarning)
            text = jax.jit(step).lower(state, x).compile().as_text()
    assert echo_calls(text) == 1       # the forward pass: the row-parallel layer's site g
    # Outside set_mesh: the same step compiles to none (and warns, as above).
    with pytest.warns(ej.EchoMeshWarning):
        text = jax.jit(step).lower(state, x).compile().as_text()
    assert echo_calls(text) == 0


def test_row2_checklist_snippet_counts_echo_calls():
    """The fast-path checklist's snippet, run on a step of the user's."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Fast-path checklist"):]
    snippet = textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    m = mesh()
    model = built_under_mesh(m)
    graphdef, state = nnx.split(model)

    def step(state, x):
        return nnx.merge(graphdef, state, copy=True)(x)

    namespace = {"jax": jax, "step": step, "args": (state, inputs()), "mesh": m}
    exec(compile(snippet, str(DOC), "exec"), namespace)  # noqa: S102
    assert namespace["n_echo"] >= 1


# --------------------------------------------------------------------------------------------
# 3. a state made for shard_map code given to a GSPMD helper


def test_row3_wrong_state_names_state_for():
    m = mesh()
    x = jax.device_put(inputs(shape=(B, H)), NamedSharding(m, P("dp", "tp")))
    w = jax.device_put(inputs(2, (H, D)), NamedSharding(m, P("tp", None)))
    with jax.set_mesh(m):
        with pytest.raises(ValueError, match=r"echo_jax\.gspmd\.state_for\(") as err:
            ej.row_parallel_matmul(x, w, config=CFG, state=ej.init_state(x))
        assert "in_specs" not in str(err.value)
        # The call the message shows works.
        state = ej.state_for(x.shape[:-1] + (w.shape[-1],), axis="tp", config=CFG)
        y, state = ej.row_parallel_matmul(x, w, config=CFG, state=state)
        assert y.shape == (B, D)
        # The column site's state is shaped like its input x.
        xc = inputs(shape=(B, D))
        wc = jax.device_put(inputs(3, (D, H)), NamedSharding(m, P(None, "tp")))
        with pytest.raises(ValueError, match=r"state_for\(x\.shape"):
            ej.column_parallel_matmul(xc, wc, config=CFG, state=ej.init_state(xc))


# --------------------------------------------------------------------------------------------
# 4. one meaning of config=None


def _per_rank(f, x):
    """f over the "tp" axis of a (4,) mesh, one rank per row of x."""
    m = make_mesh((4,), ("tp",))
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=P("tp"), out_specs=P()))(x)


def test_row4_config_none_is_exact_everywhere_and_echo_psum_warns():
    x = jax.random.normal(jax.random.key(3), (4, 1024))
    exact = jnp.sum(x, axis=0, keepdims=True)

    # echo_psum without a config: the drop-in for lax.psum is Echo (4-bit), and says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y_default = _per_rank(lambda v: ej.echo_psum(v, "tp"), x)
    assert 0.01 < rel_err(y_default, exact) < 0.3

    # echo_psum(config=None): the old meaning still runs, with a warning naming the new one.
    with pytest.warns(FutureWarning, match=r"exact lax\.psum.*EchoConfig\(\)"):
        y_none = _per_rank(lambda v: ej.echo_psum(v, "tp", config=None), x)
    np.testing.assert_array_equal(y_none, y_default)

    # The tp sites, the GSPMD helpers and the layers: config=None is the exact psum.
    y_site = _per_rank(lambda v: tp.forward_site(v, "tp", None)[0], x)
    np.testing.assert_allclose(y_site, exact, rtol=1e-5, atol=1e-5)

    m = mesh()
    xs = jax.device_put(inputs(shape=(B, H)), NamedSharding(m, P("dp", "tp")))
    w = jax.device_put(inputs(2, (H, D)), NamedSharding(m, P("tp", None)))
    with jax.set_mesh(m):
        y_helper = ej.row_parallel_matmul(xs, w, config=None)
        layer = ejnnx.RowParallelLinear(H, D, config=None, use_bias=False, rngs=nnx.Rngs(0))
        y_layer = layer(xs)
    dense = jnp.dot(inputs(shape=(B, H)), inputs(2, (H, D)),
                    precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(y_helper, dense, rtol=1e-4, atol=1e-4)
    k = layer.kernel[...]
    np.testing.assert_allclose(y_layer, jnp.dot(inputs(shape=(B, H)), k,
                                                precision=lax.Precision.HIGHEST),
                               rtol=1e-4, atol=1e-4)
