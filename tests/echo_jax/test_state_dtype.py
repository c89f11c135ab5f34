"""`EchoConfig.state_dtype`: the compensator state stored in bfloat16.

Semantics checked against a NumPy reference written here (not the code's own functions): the apply
step and the update run in fp32 on the state widened exactly, and only the stored m1, m2 are
rounded to bfloat16 (round to nearest even) at every call. Also: xla == p2p bit for bit with a
bfloat16 state (the CPU custom call fusing it, asserted in the compiled program), the dtype
survives jit / scan / grad, bad values are rejected with a message that names the field, and the
models thread the state in the config's dtype. The CUDA kernels' bf16 state:
test_p2p_cuda.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import echo_jax as ej
from echo_jax import collective
from echo_jax import tp
from echo_jax import transports
from conftest import compensated_sites
from np_reference import coefficients

BF16 = ej.EchoConfig(bits=4, transport="xla", state_dtype="bfloat16")
F32 = np.float32


def bf16_round(a):
    """fp32 -> the nearest bfloat16 value (ties to even), returned as fp32: integer arithmetic on
    the upper 16 bits of the fp32 pattern (finite inputs)."""
    b = np.asarray(a, F32).view(np.uint32).astype(np.uint64)
    lsb = (b >> 16) & 1
    r = ((b + 0x7FFF + lsb) >> 16) << 16
    return r.astype(np.uint32).view(F32)


def bits(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).view(np.uint32)


def ref_step(x, m1, m2, y, nranks, cfg, store=bf16_round):
    """One call of Algorithm 1 in fp32 with the coefficients from the config's fields
    (np_reference); m1, m2 are the stored (bf16-valued) state as fp32; returns x', new m1, m2."""
    ea, eb, b1, c1, b2, c2 = coefficients(cfg)
    x, m1, m2, y = (np.asarray(a, F32) for a in (x, m1, m2, y))
    xp = x + ((ea * m1).astype(F32) + (eb * m2).astype(F32))              # Eq. 10
    u = xp - (y * F32(1.0 / nranks)).astype(F32)                          # Eq. 4
    n1 = (b1 * m1).astype(F32) + (c1 * u).astype(F32)                     # Eq. 11, fp32
    n2 = (b2 * m2).astype(F32) + (c2 * u).astype(F32)
    return xp, store(n1), store(n2)


def vmapped(cfg, rescale=False):
    return jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s,
                                                      rescale=rescale), axis_name="tp"))


def uncompensated(cfg):
    return jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg), axis_name="tp"))


def bf16_state(shape, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return ej.CompensatorState((0.05 * jax.random.normal(k1, shape)).astype(jnp.bfloat16),
                               (0.05 * jax.random.normal(k2, shape)).astype(jnp.bfloat16))


# --------------------------------------------------------------------------------------------
# config, init_state, check_state


@pytest.mark.parametrize("value,name", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), (jnp.float32, "float32"),
    (jnp.bfloat16, "bfloat16"), (np.float32, "float32"), (jnp.dtype("bfloat16"), "bfloat16"),
    (np.dtype("float32"), "float32"), ("f4", "float32"),
])
def test_state_dtype_accepts_dtypes_and_names(value, name):
    cfg = ej.EchoConfig(state_dtype=value)
    assert cfg.state_dtype == name and isinstance(cfg.state_dtype, str)
    assert hash(cfg) == hash(ej.EchoConfig(state_dtype=name))
    assert cfg == ej.EchoConfig(state_dtype=name)
    assert ej.EchoConfig().state_dtype == "float32"


@pytest.mark.parametrize("value", ["float16", "bf16", "float64", "uint8", "", 16, 1.0, True, None,
                                   jnp.float16, np.float64, [1]])
def test_state_dtype_rejects_other_values(value):
    with pytest.raises(ValueError, match=r"EchoConfig\.state_dtype must be one of"):
        ej.EchoConfig(state_dtype=value)
    with pytest.raises(ValueError, match=r"EchoConfig\.state_dtype"):
        ej.EchoConfig().replace(state_dtype=value)


def test_init_state_dtype():
    x = jnp.ones((3, 5), jnp.bfloat16)
    assert ej.init_state(x).m1.dtype == jnp.float32                       # default unchanged
    s = ej.init_state(x, BF16)
    assert s.m1.dtype == s.m2.dtype == jnp.bfloat16 and s.m1.shape == (3, 5)
    assert ej.init_state(x, ej.EchoConfig()).m2.dtype == jnp.float32
    assert ej.init_state(x, dtype="bfloat16").m1.dtype == jnp.bfloat16
    assert ej.init_state(x, dtype=jnp.bfloat16).m2.dtype == jnp.bfloat16
    tree = ej.init_state({"a": jax.ShapeDtypeStruct((4,), jnp.float32), "b": x}, BF16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(tree))
    with pytest.raises(ValueError, match="disagrees with EchoConfig.state_dtype"):
        ej.init_state(x, BF16, dtype="float32")
    with pytest.raises(ValueError, match=r"EchoConfig\.state_dtype must be one of"):
        ej.init_state(x, dtype="float16")


def test_state_of_the_wrong_dtype_is_rejected():
    x = jnp.ones((2, 256))
    with pytest.raises(ValueError, match=r"state\.m1 must be bfloat16 .*state_dtype='bfloat16'"):
        vmapped(BF16)(x, ej.init_state(x))
    with pytest.raises(ValueError, match=r"state\.m1 must be float32"):
        vmapped(BF16.replace(state_dtype="float32"))(x, ej.init_state(x, BF16))


def test_a_bf16_state_is_fused_where_the_transport_takes_one():
    # The custom calls (CPU handler, CUDA kernels) take a bf16 state; the xla transport has no
    # fused call at all.
    for t in (transports.CPU, transports.CUDA):
        assert transports.fused_state_dtypes(t)[:2] == ("float32", "bfloat16")
        assert transports.call_modes(t, BF16, "bfloat16")[1] == "fused"
        assert transports.call_modes(t, ej.EchoConfig(), "float32")[1] == "fused"
    assert transports.fused_state_dtypes(transports.XLA) == ()
    assert transports.call_modes(transports.XLA, BF16, "bfloat16")[1] == "jax"


# --------------------------------------------------------------------------------------------
# semantics against the NumPy reference


def test_bf16_round_reference_is_round_to_nearest_even():
    # The reference rounding itself, on ties and near-ties (both directions), against ml_dtypes.
    import ml_dtypes
    base = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -1.0 - 2 ** -8, 3.0e-3, -7.5e4],
                    F32).view(np.uint32)
    cases = np.concatenate([base + d for d in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]).view(F32)
    want = cases.astype(ml_dtypes.bfloat16).astype(F32)
    np.testing.assert_array_equal(bf16_round(cases).view(np.uint32), want.view(np.uint32))
    assert bf16_round(np.array([1.0 + 2 ** -8], F32))[0] == 1.0                # tie -> even
    assert bf16_round(np.array([1.0 + 3 * 2 ** -8], F32))[0] == 1.0 + 2 ** -6  # tie -> even (up)


@pytest.mark.grid("bfloat16-3")
@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16])
def test_one_call_equals_fp32_algorithm_1_with_the_stored_state_rounded(nranks, xdtype):
    x = jax.random.normal(jax.random.key(nranks), (nranks, 777)).astype(xdtype)
    st = bf16_state(x.shape, nranks)
    y, new = vmapped(BF16)(x, st)
    assert new.m1.dtype == new.m2.dtype == jnp.bfloat16 and y.dtype == xdtype
    m1, m2 = np.asarray(st.m1, F32), np.asarray(st.m2, F32)     # the stored state, widened
    xp = ref_step(np.asarray(x, F32), m1, m2, np.zeros_like(m1), nranks, BF16)[0]
    # The fp32 sum of the reference x' (the state is updated with it, before its rounding to
    # x's dtype): the apply step read the stored bf16 state widened exactly, x was not rounded.
    y32 = np.asarray(uncompensated(BF16)(jnp.asarray(xp)))
    np.testing.assert_array_equal(bits(y), bits(jnp.asarray(y32).astype(xdtype)))
    _, r1, r2 = ref_step(np.asarray(x, F32), m1, m2, y32, nranks, BF16)
    np.testing.assert_array_equal(bits(new.m1), r1.view(np.uint32))
    np.testing.assert_array_equal(bits(new.m2), r2.view(np.uint32))
    # Not vacuous: the fp32-stored update differs from the rounded one.
    _, f1, _ = ref_step(np.asarray(x, F32), m1, m2, y32, nranks, BF16, store=lambda v: v)
    assert np.mean(f1 != r1) > 0.9


@pytest.mark.parametrize("rescale", [False, True])
def test_several_calls_in_one_scan_round_the_state_every_step(rescale):
    """K calls inside one jit + scan (where XLA could drop a bf16 round trip if allowed excess
    precision): the state after each call equals the NumPy chain that rounds it every step."""
    nranks, k, n = 3, 5, 640
    xs = jax.random.normal(jax.random.key(7), (k, nranks, n))
    cfg = BF16.replace(eta=0.9, blend=0.6, beta1=0.8, beta2=0.25)

    def one_rank(xs_r):
        def body(s, x):
            y, s = ej.echo_psum(x, "tp", config=cfg, state=s, rescale=rescale)
            return s, (y, s)
        return lax.scan(body, ej.init_state(xs_r[0], cfg), xs_r)[1]

    ys, states = jax.jit(jax.vmap(one_rank, in_axes=1, out_axes=1, axis_name="tp"))(xs)
    assert states.m1.dtype == jnp.bfloat16 and states.m1.shape == (k, nranks, n)
    m1 = m2 = np.zeros((nranks, n), F32)
    for i in range(k):
        _, m1, m2 = ref_step(xs[i], m1, m2, ys[i], nranks, cfg)
        np.testing.assert_array_equal(bits(states.m1[i]), m1.view(np.uint32), err_msg=f"m1 {i}")
        np.testing.assert_array_equal(bits(states.m2[i]), m2.view(np.uint32), err_msg=f"m2 {i}")
    assert np.abs(m1).max() > 0


def test_float32_state_is_unchanged():
    """state_dtype='float32' (explicit) gives today's bits: the fp32 reference, nothing rounded."""
    nranks = 4
    cfg = ej.EchoConfig(bits=4, transport="xla", state_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(3), (nranks, 500))
    k1, k2 = jax.random.split(jax.random.key(4))
    st = ej.CompensatorState(0.05 * jax.random.normal(k1, x.shape),
                             0.05 * jax.random.normal(k2, x.shape))
    y, new = vmapped(cfg)(x, st)
    _, r1, r2 = ref_step(x, st.m1, st.m2, y, nranks, cfg, store=lambda v: v)
    np.testing.assert_array_equal(bits(new.m1), r1.view(np.uint32))
    np.testing.assert_array_equal(bits(new.m2), r2.view(np.uint32))
    y0, n0 = vmapped(ej.EchoConfig(bits=4, transport="xla"))(x, st)
    np.testing.assert_array_equal(bits(y), bits(y0))
    np.testing.assert_array_equal(bits(new.m1), bits(n0.m1))


# --------------------------------------------------------------------------------------------
# transports


@pytest.mark.grid("4-bfloat16-none", "3-float16-hadamard")
@pytest.mark.parametrize("nranks,xdtype,rotation", [
    (2, jnp.float32, "none"), (4, jnp.float32, "none"), (2, jnp.bfloat16, "none"),
    (4, jnp.bfloat16, "none"), (3, jnp.float16, "hadamard"), (4, jnp.float32, "hadamard")])
def test_xla_equals_p2p_bit_for_bit_with_a_bf16_state(nranks, xdtype, rotation):
    from echo_jax.transports import cpu
    if "cpu" not in cpu.available_platforms():
        pytest.skip("echo_jax._ffi (the compiled custom call) is not built")
    if len(jax.devices()) < nranks:
        pytest.skip(f"needs {nranks} devices")
    n, steps = 1000, 3
    xs = jax.random.normal(jax.random.key(nranks), (nranks, steps, n)).astype(xdtype)

    def run(transport):
        cfg = BF16.replace(transport=transport, rotation=rotation)
        out, text = compensated_sites(cfg, xs)
        # p2p: the fused call, once a step (apply and update inside it); xla: no custom call.
        target = 'custom_call_target="{}"'.format
        assert text.count(target(cpu.TARGET_COMPENSATED)) == (steps if transport == "p2p" else 0)
        assert target(cpu.TARGET) not in text
        return out

    got, want = run("p2p"), run("xla")
    assert got[1].dtype == jnp.bfloat16
    for a, b, what in zip(got, want, ("y", "m1", "m2")):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)
    assert np.abs(np.asarray(got[1], F32)).max() > 0


def test_fused_entry_points_refuse_a_state_of_another_dtype():
    from echo_jax.transports import explicit
    x = jnp.ones((2, 256))
    s16, s32 = ej.init_state(x, BF16), ej.init_state(x)

    def f(cfg):
        return jax.vmap(lambda v, a, b: explicit.p2p_allreduce_compensated(v, a, b, "tp", 2, cfg),
                        axis_name="tp")
    with pytest.raises(ValueError, match=r"m1_flat must be float32 \(EchoConfig.state_dtype\), "
                                         r"got bfloat16"):
        f(BF16.replace(state_dtype="float32"))(x, s16.m1, s16.m2)
    with pytest.raises(ValueError, match=r"m1_flat must be bfloat16 \(EchoConfig.state_dtype\), "
                                         r"got float32"):
        f(BF16)(x, s32.m1, s32.m2)
    # The right dtype runs (under vmap: the xla transport's apply and update in JAX).
    y, m1, m2 = f(BF16)(x, s16.m1, s16.m2)
    assert m1.dtype == m2.dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------
# through jit, scan and grad (the TP sites), and the models


def test_tp_sites_keep_the_dtype_through_grad():
    nranks, shape = 2, (4, 256)
    x = jax.random.normal(jax.random.key(0), (nranks,) + shape)

    def loss(x_r, bwd):
        h, bwd = tp.backward_site(x_r, "tp", BF16, bwd)
        fwd = ej.init_state(h, BF16)
        y, fwd = tp.forward_site(h * 1.5, "tp", BF16, fwd)
        y, fwd = tp.forward_site(y * h, "tp", BF16, fwd)
        return jnp.sum(jnp.sin(y)), fwd

    g = jax.grad(loss, argnums=(0, 1), has_aux=True)
    (gx, gstate), fwd = jax.jit(jax.vmap(g, in_axes=(0, None), axis_name="tp"))(
        x, ej.init_state(x[0], BF16))
    assert fwd.m1.dtype == jnp.bfloat16 and gstate.m1.dtype == jnp.bfloat16
    assert gx.dtype == jnp.float32
    assert float(jnp.abs(gstate.m1.astype(jnp.float32)).max()) > 0    # the live backward state


@pytest.mark.slow
def test_models_thread_a_bf16_state():
    from models import config as C
    from models import model as M
    from models.cli import add_comm_args, comm_from_args
    import argparse

    ap = argparse.ArgumentParser()
    add_comm_args(ap)
    comm = comm_from_args(ap.parse_args(["--tp", "2", "--bits", "4", "--state-dtype",
                                         "bfloat16"]))
    assert comm.echo.state_dtype == "bfloat16" and comm.state_dtype == "bfloat16"
    assert comm_from_args(ap.parse_args(["--tp", "2", "--bits", "4"])).state_dtype == "float32"
    assert C.CommConfig(tp=2).state_dtype == "float32"
    with pytest.raises(SystemExit):
        ap.parse_args(["--state-dtype", "float16"])

    cfg = C.get_config("tiny")
    full = M.init_params(jax.random.key(0), cfg)
    st = M.shard_params(full, 2, cfg)
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size, jnp.int32)
    x, y = toks[:, :-1], toks[:, 1:]
    bs0 = ej.init_state(jnp.zeros((2, 8, cfg.dim)), comm.echo)
    f = jax.grad(lambda p, s: M.loss_local(p, x, y, cfg, comm, bwd_state=s), (0, 1))
    _, final = jax.jit(jax.vmap(f, in_axes=(0, None), axis_name="tp"))(st, bs0)
    assert final.m1.dtype == jnp.bfloat16 and float(jnp.abs(final.m1.astype(F32)).max()) > 0
    _, norms = M.apply_simulated(st, x, cfg, comm, return_state_norms=True)
    assert np.all(np.asarray(norms).reshape(2, -1)[:, 1:] > 0)
    # An fp32 initial state is refused by a bf16 comm with the message of check_state.
    with pytest.raises(ValueError, match=r"must be bfloat16"):
        jax.vmap(f, in_axes=(0, None), axis_name="tp")(st, ej.init_state(jnp.zeros((2, 8,
                                                                                    cfg.dim))))
