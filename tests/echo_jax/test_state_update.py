"""`EchoConfig.state_update="separate"`: the compensator's update as its own op after the call.

The Echo paper Sec. 5.3 / Appendix C: the apply step runs in the all-reduce's entry pass and the
update (Eq. 4, 11) beside the next matrix multiplication, on a stream of its own. Checked here:

* the semantics against a NumPy reference written here: u = x' - y / P with y as the call
  returned it (rounded to x's dtype); for float32 x the bits of "in_call", for a 16-bit x the
  output's rounding fed back too (and so different bits from "in_call");
* the CPU custom call's applied target (apply step only, m1 and m2 read-only operands) equals
  the xla transport bit for bit, over P, bits, policy, dtypes, the state dtype, the rotation and
  the rescaling; the compiled program holds the applied call once a site and no fused call;
* the update op carries the GPU stream annotation where it runs on GPUs
  (ECHO_JAX_UPDATE_STREAM; 0 leaves it unannotated), and a bad value of it is refused;
* jit / scan / grad: a scan over sites with the state as the carry, gradients equal to
  "in_call"'s; bad config values are refused with a message naming the field.

The CUDA kernels' applied call: test_p2p_cuda.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import echo_jax as ej
from echo_jax import collective
from echo_jax import compensator as comp
from echo_jax import transports
from conftest import compensated_sites
from np_reference import coefficients

F32 = np.float32


def bits(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).view(np.uint32)


def ref_update(x, m1, m2, y, nranks, cfg):
    """The separate update in NumPy fp32 from the config's fields (np_reference): x' from x, m1,
    m2 (Eq. 10), u = x' - y / P with y as returned, widened (Eq. 4), the averages (Eq. 11); a
    bfloat16 state is not used here (float32 state)."""
    ea, eb, b1, c1, b2, c2 = coefficients(cfg)
    x, m1, m2, y = (np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (x, m1, m2, y))
    xp = x + ((ea * m1).astype(F32) + (eb * m2).astype(F32))
    u = xp - (y * F32(1.0 / nranks)).astype(F32)
    return (b1 * m1).astype(F32) + (c1 * u).astype(F32), (b2 * m2).astype(F32) + (c2 * u).astype(F32)


def vmapped(cfg):
    return jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s,
                                                      rescale=False), axis_name="tp"))


def random_state(shape, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return ej.CompensatorState(0.05 * jax.random.normal(k1, shape),
                               0.05 * jax.random.normal(k2, shape))


def cpu_custom_call_or_skip(nranks):
    from echo_jax.transports import cpu
    if "cpu" not in cpu.available_platforms():
        pytest.skip("echo_jax._ffi (the compiled custom call) is not built")
    if len(jax.devices()) < nranks:
        pytest.skip(f"needs {nranks} devices")


# --------------------------------------------------------------------------------------------
# config


def test_state_update_values():
    assert ej.EchoConfig().state_update == "in_call"
    assert ej.EchoConfig(state_update="separate").state_update == "separate"
    for bad in ("fused", "beside", "", None, 1, True):
        with pytest.raises(ValueError, match=r"EchoConfig\.state_update must be one of "
                                             r"\('in_call', 'separate'\)"):
            ej.EchoConfig(state_update=bad)


# --------------------------------------------------------------------------------------------
# semantics (the xla transport under vmap) against NumPy


@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_separate_update_matches_the_numpy_reference(xdtype):
    nranks = 4
    cfg = ej.EchoConfig(bits=4, transport="xla", state_update="separate")
    # Contributions around 3 (not 0): every group of the sum is one-sided, so its zero-point is
    # a fraction and y = code * s - z * s has more significant bits than fp16 holds. Around 0,
    # a 4-bit group of the sum straddles zero with z = 7 or 8, and y = (code - z) * s, at most
    # 8 times the 8-bit bf16 scale, is an fp16 value: rounding y to fp16 would change nothing.
    x = (jax.random.normal(jax.random.key(1), (nranks, 700)) + 3.0).astype(xdtype)
    st = random_state(x.shape, 2)
    y, new = vmapped(cfg)(x, st)
    r1, r2 = ref_update(x, st.m1, st.m2, y, nranks, cfg)
    np.testing.assert_array_equal(bits(new.m1), r1.view(np.uint32))
    np.testing.assert_array_equal(bits(new.m2), r2.view(np.uint32))
    # y is the apply step's all-reduce, as with the update in the call.
    y_in, new_in = vmapped(cfg.replace(state_update="in_call"))(x, st)
    np.testing.assert_array_equal(bits(y), bits(y_in))
    if xdtype == jnp.float32:   # y as returned is the fp32 sum: the very same update
        np.testing.assert_array_equal(bits(new.m1), bits(new_in.m1))
        np.testing.assert_array_equal(bits(new.m2), bits(new_in.m2))
    else:                       # a 16-bit y's rounding is fed back too
        assert (bits(new.m1) != bits(new_in.m1)).any()


def test_separate_update_with_a_bf16_state_rounds_the_stored_state():
    nranks = 4
    cfg = ej.EchoConfig(bits=4, transport="xla", state_update="separate",
                        state_dtype="bfloat16")
    x = jax.random.normal(jax.random.key(5), (nranks, 512)).astype(jnp.bfloat16)
    s32 = random_state(x.shape, 6)
    st = ej.CompensatorState(s32.m1.astype(jnp.bfloat16), s32.m2.astype(jnp.bfloat16))
    y, new = vmapped(cfg)(x, st)
    assert new.m1.dtype == new.m2.dtype == jnp.bfloat16
    r1, r2 = ref_update(x, st.m1, st.m2, y, nranks, cfg)
    want1 = np.asarray(jnp.asarray(r1).astype(jnp.bfloat16).astype(jnp.float32))
    want2 = np.asarray(jnp.asarray(r2).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(bits(new.m1), want1.view(np.uint32))
    np.testing.assert_array_equal(bits(new.m2), want2.view(np.uint32))


def test_update_beside_is_the_in_call_update_for_float32():
    """`compensator.update_beside` (the op itself, stream 0 and 1 on CPU) against
    apply_correction + update_state written out."""
    cfg = ej.EchoConfig()
    k = comp.Coefficients.from_config(cfg)
    x = jax.random.normal(jax.random.key(7), (3, 128))
    y = 4.0 * jax.random.normal(jax.random.key(8), (3, 128))
    st = random_state(x.shape, 9)
    r1, r2 = ref_update(x, st.m1, st.m2, y, 4, cfg)
    for stream in (0, 1):
        new = jax.jit(lambda a, b, s: comp.update_beside(a, b, 4, s, k, stream))(x, y, st)
        np.testing.assert_array_equal(bits(new.m1), r1.view(np.uint32))
        np.testing.assert_array_equal(bits(new.m2), r2.view(np.uint32))


# --------------------------------------------------------------------------------------------
# the CPU custom call's applied target == the xla transport


@pytest.mark.grid("3-bfloat16-float32-none-4-asym-False", "2-float32-bfloat16-hadamard-8-asym-True")
@pytest.mark.parametrize("nranks,xdtype,state_dtype,rotation,bits_,policy,rescale", [
    (2, jnp.float32, "float32", "none", 4, "asym", False),
    (4, jnp.float32, "float32", "none", 8, "sym", "auto"),
    (3, jnp.bfloat16, "float32", "none", 4, "asym", False),
    (4, jnp.bfloat16, "bfloat16", "none", 4, "asym_naive", True),
    (4, jnp.float16, "float32", "hadamard", 4, "asym", False),
    (2, jnp.float32, "bfloat16", "hadamard", 8, "asym", True),
])
def test_applied_call_equals_xla_bit_for_bit(nranks, xdtype, state_dtype, rotation, bits_,
                                             policy, rescale):
    from echo_jax.transports import cpu
    cpu_custom_call_or_skip(nranks)
    n, steps = 1000, 3
    xs = jax.random.normal(jax.random.key(nranks), (nranks, steps, n)).astype(xdtype)

    def run(transport):
        cfg = ej.EchoConfig(bits=bits_, policy=policy, transport=transport, rotation=rotation,
                            state_dtype=state_dtype, state_update="separate")
        out, text = compensated_sites(cfg, xs, rescale=rescale)
        target = 'custom_call_target="{}"'.format
        assert text.count(target(cpu.TARGET_APPLIED)) == (steps if transport == "p2p" else 0)
        assert target(cpu.TARGET_COMPENSATED) not in text
        assert target(cpu.TARGET) not in text
        return out

    got, want = run("p2p"), run("xla")
    for a, b, what in zip(got, want, ("y", "m1", "m2")):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)
    assert np.abs(np.asarray(got[1], F32)).max() > 0


def test_applied_call_is_chosen_only_where_the_transport_has_it():
    cfg = ej.EchoConfig(state_update="separate")
    assert transports.has_fused_apply(transports.CPU)
    assert transports.has_fused_apply(transports.CUDA)
    assert not transports.has_fused_apply(transports.XLA)
    assert transports.call_modes(transports.CPU, cfg, "float32")[1] == "applied"
    assert transports.call_modes(transports.XLA, cfg, "float32")[1] == "jax"


# --------------------------------------------------------------------------------------------
# the stream annotation


def test_the_plan_runs_the_separate_update_as_one_pass_where_the_transport_has_one():
    cfg = ej.EchoConfig(state_update="separate")
    cuda_plan = transports.plan_with(transports.CUDA, cfg, state_dtype="float32")
    assert (cuda_plan.compensation, cuda_plan.separate_update) == ("applied", "kernel")
    assert "update separate (kernel)" in cuda_plan.describe()
    for t in (transports.CPU, transports.XLA):
        assert transports.plan_with(t, cfg, state_dtype="float32").separate_update == "jax"
    assert transports.plan_with(transports.CUDA, cfg.replace(state_update="in_call"),
                                state_dtype="float32").separate_update == "none"


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_cuda_update_kernel_is_the_reference_bit_for_bit(xdtype, state_dtype):
    from conftest import cuda_handlers
    cuda_handlers()  # skips without a GPU; fails where one is present and the module is not
    from echo_jax.transports import cuda
    nranks = 4
    cfg = ej.EchoConfig(state_update="separate", state_dtype=state_dtype)
    k = comp.Coefficients.from_config(cfg)
    kernel = jax.jit(lambda x, y, s: cuda.update_state(x, y, s, nranks, cfg))
    reference = jax.jit(lambda x, y, s: comp.update_beside(x, y, nranks, s, k, 0))
    for n in (1, 7, 8, 1000, 4099, 1 << 20):  # the packed loop, its tail, the one-by-one path
        x = jax.random.normal(jax.random.key(n), (nranks, n)).astype(xdtype)
        y = (nranks * jax.random.normal(jax.random.key(n + 1), (nranks, n))).astype(xdtype)
        if n >= 8:  # non-finite values: the same NaN / inf positions as the reference
            x = x.at[0, 3].set(jnp.inf).at[1, 5].set(jnp.nan)
        st = random_state(x.shape, n)
        st = comp.CompensatorState(st.m1.astype(state_dtype), st.m2.astype(state_dtype))
        got, want = kernel(x, y, st), reference(x, y, st)
        for g, w, what in ((got.m1, want.m1, "m1"), (got.m2, want.m2, "m2")):
            assert g.dtype == w.dtype == jnp.dtype(state_dtype) and g.shape == w.shape
            g32, w32 = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
            np.testing.assert_array_equal(np.isnan(g32), np.isnan(w32), err_msg=what)
            finite = ~np.isnan(w32)
            np.testing.assert_array_equal(g32[finite].view(np.uint32),
                                          w32[finite].view(np.uint32), err_msg=f"{what} n={n}")
        if state_dtype == "float32" and n >= 8:  # and against NumPy, from the formulas
            r1, r2 = ref_update(x, st.m1, st.m2, y, nranks, cfg)
            ok = np.isfinite(r1)
            np.testing.assert_array_equal(bits(got.m1)[ok], r1.view(np.uint32)[ok])
            np.testing.assert_array_equal(bits(got.m2)[ok], r2.view(np.uint32)[ok])


def _lowered(cfg, monkeypatch, on_gpu):
    monkeypatch.setattr(transports.base, "on_gpu", lambda: on_gpu)
    x = jnp.ones((2, 256))
    return vmapped(cfg).lower(x, ej.init_state(x)).as_text()


def test_the_update_is_annotated_for_a_second_stream_on_gpus(monkeypatch):
    cfg = ej.EchoConfig(transport="xla", state_update="separate")
    monkeypatch.delenv(comp.UPDATE_STREAM_ENV, raising=False)
    text = _lowered(cfg, monkeypatch, on_gpu=True)
    assert re.search(r'_xla_stream_annotation = "1"', text), "no stream annotation"
    monkeypatch.setenv(comp.UPDATE_STREAM_ENV, "3")
    assert '_xla_stream_annotation = "3"' in _lowered(cfg, monkeypatch, on_gpu=True)
    monkeypatch.setenv(comp.UPDATE_STREAM_ENV, "0")
    assert "_xla_stream_annotation" not in _lowered(cfg, monkeypatch, on_gpu=True)
    monkeypatch.delenv(comp.UPDATE_STREAM_ENV)
    assert "_xla_stream_annotation" not in _lowered(cfg, monkeypatch, on_gpu=False)
    assert "_xla_stream_annotation" not in _lowered(cfg.replace(state_update="in_call"),
                                                    monkeypatch, on_gpu=True)


@pytest.mark.parametrize("raw", ["-1", "65", "one", "1.5"])
def test_a_bad_update_stream_is_refused(monkeypatch, raw):
    monkeypatch.setenv(comp.UPDATE_STREAM_ENV, raw)
    with pytest.raises(ValueError, match=rf"ECHO_JAX_UPDATE_STREAM must be an int in \[0, 64\].*"
                                         rf"got '{re.escape(raw)}'"):
        comp.update_stream()


# --------------------------------------------------------------------------------------------
# jit / scan / grad


def test_a_scan_over_sites_and_grad_match_in_call_for_float32():
    """A pass of compensated sites in a scan (the state as the carry) under grad: the loss, the
    gradient and the final state of "separate" equal "in_call"'s bit for bit (fp32)."""
    nranks, sites = 4, 3
    xs = jax.random.normal(jax.random.key(12), (nranks, sites, 4, 128))
    w = jax.random.normal(jax.random.key(13), (128, 128)) / 11.0

    def program(state_update):
        cfg = ej.EchoConfig(transport="xla", state_update=state_update)

        def per_rank(x, w):
            def loss(w):
                def site(s, xk):
                    y, s = ej.echo_psum(jnp.tanh(xk @ w), "tp", config=cfg, state=s)
                    return s, jnp.sum(y * y)
                s, parts = lax.scan(site, ej.init_state(x[0]), x)
                return jnp.sum(parts), s
            (val, s), g = jax.value_and_grad(loss, has_aux=True)(w)
            return val, g, s
        return jax.jit(jax.vmap(per_rank, in_axes=(0, None), axis_name="tp"))(xs, w)

    got, want = program("separate"), program("in_call")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert float(jnp.abs(got[2].m1).max()) > 0


def _comms_from_the_cli_flag():
    """{"in_call", "separate"}: the CommConfig of `--tp 2 --bits 4 --state-update U`, parsed as
    the model CLIs parse it."""
    import argparse

    from models.cli import add_comm_args, comm_from_args

    ap = argparse.ArgumentParser()
    add_comm_args(ap)
    return ap, {u: comm_from_args(ap.parse_args(["--tp", "2", "--bits", "4",
                                                 "--state-update", u]))
                for u in ("in_call", "separate")}


def test_the_cli_flag_sets_the_state_update():
    """`--state-update separate` reaches the EchoConfig of the model CLIs; a bad value is a usage
    error. (That the model's sites then run it: the training step below, slow set, and
    test_the_annotated_update_runs_under_remat_and_grad.)"""
    from models.cli import comm_from_args

    ap, comms = _comms_from_the_cli_flag()
    assert comms["separate"].echo.state_update == "separate"
    assert comms["in_call"].echo.state_update == "in_call"
    assert comm_from_args(ap.parse_args(["--tp", "2"])).tp == 2
    with pytest.raises(SystemExit):
        ap.parse_args(["--state-update", "beside"])


@pytest.mark.slow   # a tiny model's forward and backward twice; the flag's parsing is in the
#                    fast set (above), the separate update in a model's sites too (below)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_training_step_through_the_cli_flag(dtype):
    """`--state-update separate` reaches every site of a model: a tiny model's loss and gradient
    (P = 2 simulated ranks, forward and backward sites compensated) equal "in_call"'s bit for
    bit in float32; in bfloat16 the run is finite and its final backward state differs (the
    16-bit outputs' rounding is fed back)."""
    import dataclasses

    from models import config as C
    from models import model as M

    _, comms = _comms_from_the_cli_flag()
    assert comms["separate"].echo.state_update == "separate"

    cfg = dataclasses.replace(C.get_config("tiny"), dtype=dtype)
    st = M.shard_params(M.init_params(jax.random.key(0), cfg), 2, cfg)
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size, jnp.int32)
    x, y = toks[:, :-1], toks[:, 1:]

    def run(comm):
        bs0 = ej.init_state(jnp.zeros((2, 8, cfg.dim)), comm.echo)
        f = jax.value_and_grad(lambda p, s: M.loss_local(p, x, y, cfg, comm, bwd_state=s),
                               (0, 1))
        return jax.jit(jax.vmap(f, in_axes=(0, None), axis_name="tp"))(st, bs0)

    got, want = run(comms["separate"]), run(comms["in_call"])
    if dtype == "float32":
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(bits(a), bits(b))
    else:
        assert all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
                   for a in jax.tree.leaves(got))
        assert (bits(got[1][1].m1) != bits(want[1][1].m1)).any()


def test_the_annotated_update_runs_under_remat_and_grad(monkeypatch):
    """The stream-annotated update (what runs on GPUs) inside a model's rematerialised layers
    under grad: compiled and run here (the CPU compiler ignores the annotation), the same bits
    as the unannotated update (ECHO_JAX_UPDATE_STREAM=0). One layer (its two forward and two
    backward sites): the scanned, rematerialised layer body is the same for any depth, and a
    second layer only lengthens the compile of both programs."""
    import dataclasses

    from models import config as C
    from models import model as M

    monkeypatch.setattr(transports.base, "on_gpu", lambda: True)  # annotate as on a GPU
    cfg = dataclasses.replace(C.get_config("tiny"), dtype="float32", n_layers=1)
    comm = C.CommConfig(tp=2, echo=ej.EchoConfig(bits=4, transport="xla",
                                                 state_update="separate"))
    # Per-rank parameters [2, ...] drawn in NumPy (Flax's init would compile a program per
    # initializer); replicated leaves (the same shape at P = 1) equal on both ranks.
    rng = np.random.default_rng(0)
    is_shape = lambda v: isinstance(v, tuple)  # noqa: E731
    full = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(
        M.param_shapes(cfg, 1), is_leaf=is_shape)[0]}

    def draw(path, shape):
        name = jax.tree_util.keystr(path)
        ranks = 1 if full[name] == shape else 2
        v = (np.ones((ranks,) + shape) if "scale" in name
             else 0.05 * rng.standard_normal((ranks,) + shape))
        return jnp.asarray(np.broadcast_to(v, (2,) + shape), jnp.dtype(cfg.param_dtype))

    st = jax.tree_util.tree_map_with_path(draw, M.param_shapes(cfg, 2), is_leaf=is_shape)
    toks = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size, jnp.int32)
    x, y = toks[:, :-1], toks[:, 1:]

    def run():
        bs0 = ej.init_state(jnp.zeros((2, 8, cfg.dim)), comm.echo)
        f = jax.value_and_grad(
            lambda p, s: M.loss_local(p, x, y, cfg, comm, bwd_state=s, remat=True), (0, 1))
        g = jax.jit(jax.vmap(f, in_axes=(0, None), axis_name="tp"))
        return g.lower(st, bs0).as_text(), g(st, bs0)

    monkeypatch.delenv(comp.UPDATE_STREAM_ENV, raising=False)
    text, got = run()
    assert "_xla_stream_annotation" in text
    monkeypatch.setenv(comp.UPDATE_STREAM_ENV, "0")
    text0, want = run()
    assert "_xla_stream_annotation" not in text0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(a), bits(b))
