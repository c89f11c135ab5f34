"""`EchoConfig.residual="local"` in the CPU custom call: the averages (Eq. 11 of the Echo paper)
take each rank's own rounding errors, updated where the call quantizes (push: x' - Q(x') of the
segments it sends; reduce: s - Q(s) of the segment it owns), instead of u = x' - y / P (Eq. 4).

The fused call (transport "p2p") against the "xla" transport, whose local residual is
`echo_jax.transports.xla.xla_allreduce_local` + `compensator.update_with_residual` in JAX: the
sums and every bit of the state (fp32, bf16, the int8 state's codes and scales) over successive
sites, rescaled or not, with a last partial group and segments of padding alone. Also the
refusals: the config's (rotation, a separate update), the applied call's, and the handler's own
check of its attributes. The float64 reference of the residual itself is in test_compensator.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import echo_jax as ej
from conftest import as_varying
from echo_jax.transports import cpu

F32 = np.float32
STEPS = 3

pytestmark = pytest.mark.skipif("cpu" not in cpu.available_platforms(),
                                reason="echo_jax._ffi (the compiled custom call) is not built")


def _sites(cfg, xs, rescale):
    """STEPS compensated echo_psum sites in a row on xs [P, STEPS, n] (a contribution of its own
    a site, so that nothing is computed from x in the program), the state carried, under
    shard_map over "tp"; returns ((ys [P, STEPS, n], state with a leading P), program text)."""
    nranks = xs.shape[0]
    if len(jax.devices()) < nranks:
        pytest.skip(f"needs {nranks} devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:nranks]), ("tp",))
    rows = PartitionSpec("tp")

    def body(x):
        s = ej.init_state(x[0, 0], cfg)
        ys = []
        for i in range(STEPS):
            y, s = ej.echo_psum(x[0, i], "tp", config=cfg, state=s, rescale=rescale)
            ys.append(as_varying(y, ("tp",)))
        return jnp.stack(ys)[None], jax.tree.map(lambda a: a[None], s)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows, out_specs=rows))
    args = jax.device_put(xs, NamedSharding(mesh, rows))
    return f(args), f.lower(args).as_text()


def _bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def _config(state_dtype, **kw):
    # The int8 state needs group_size 128 (a wire group is a state group); the others take a
    # smaller group, so that a segment holds several.
    g = 128 if state_dtype == "int8" else 32
    return ej.EchoConfig(bits=4, group_size=g, state_dtype=state_dtype, residual="local", **kw)


def _inputs(nranks, n, dtype, seed):
    xs = np.asarray(jax.random.normal(jax.random.key(seed), (nranks, STEPS, n)), F32) * 3
    return jnp.asarray(xs).astype(dtype)


CASES = [(nranks, dtype, state, rescale)
         for nranks in (2, 3, 4)
         for dtype in ("float32", "bfloat16")
         for state in ("float32", "bfloat16", "int8")
         for rescale in (False, True)]


def _id(nranks, dtype, state, rescale):
    return f"P{nranks}-x_{dtype}-state_{state}-{'rescaled' if rescale else 'plain'}"


@pytest.mark.grid("P3-x_float32-state_float32-rescaled", "P2-x_bfloat16-state_bfloat16-plain",
                  "P4-x_bfloat16-state_int8-rescaled")
@pytest.mark.parametrize("nranks, dtype, state, rescale", CASES, ids=[_id(*c) for c in CASES])
def test_the_cpu_call_matches_the_xla_transport_bit_for_bit(nranks, dtype, state, rescale):
    """The sums and the state after each of three sites, against the "xla" transport. n = 333:
    a last partial group, and with g = 128 and P = 4 a segment of padding alone (its groups
    carry no state); the fast set runs one case a state format."""
    n = 333
    xs = _inputs(nranks, n, dtype, seed=100 * nranks + n + len(state))
    cfg = _config(state, transport="p2p")
    (y_call, s_call), text = _sites(cfg, xs, rescale)
    target = cpu.TARGET_COMPENSATED_Q8 if state == "int8" else cpu.TARGET_COMPENSATED
    assert text.count(f"custom_call @{target}(") == STEPS, "the fused call runs every site"
    assert text.count("residual_local = 1 : i64") == STEPS
    (y_ref, s_ref), _ = _sites(cfg.replace(transport="xla"), xs, rescale)
    np.testing.assert_array_equal(_bits(y_call), _bits(y_ref), err_msg="y")
    leaves_call, leaves_ref = jax.tree.leaves(s_call), jax.tree.leaves(s_ref)
    assert len(leaves_call) == (4 if state == "int8" else 2)
    for i, (got, want) in enumerate(zip(leaves_call, leaves_ref, strict=True)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"state leaf {i}")
    # The state is live (the residuals are nonzero) and differs from the "output" residual's.
    assert np.any(_bits(leaves_call[0]) != 0)
    (_, s_out), _ = _sites(cfg.replace(residual="output"), xs, rescale)
    assert any(not np.array_equal(_bits(a), _bits(b))
               for a, b in zip(leaves_call, jax.tree.leaves(s_out), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("nranks, n, bits, policy", [(2, 1, 8, "asym"), (3, 31, 8, "sym"),
                                                     (4, 1025, 4, "asym_naive")])
def test_odd_layouts_and_formats(nranks, n, bits, policy):
    """A single element, n below one group, n just past a multiple of g, 8 bits and the other
    policies, with the fp32 state."""
    xs = _inputs(nranks, n, "float32", seed=7 * n + nranks)
    cfg = _config("float32", transport="p2p").replace(bits=bits, policy=policy,
                                                       group_size=32 if bits == 4 else 31)
    got, _ = _sites(cfg, xs, True)
    want, _ = _sites(cfg.replace(transport="xla"), xs, True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_the_config_refuses_a_rotation_and_a_separate_update():
    with pytest.raises(ValueError, match=r"residual='local'.*rotation='none'"):
        ej.EchoConfig(residual="local", rotation="hadamard")
    with pytest.raises(ValueError, match=r"residual='local'.*state_update='in_call'"):
        ej.EchoConfig(residual="local", state_update="separate")
    with pytest.raises(ValueError, match=r"EchoConfig.residual must be one of"):
        ej.EchoConfig(residual="sum")


def _direct(fn, nranks=2, n=256):
    """Runs fn(x, m1, m2) (one rank's flat values) under shard_map over nranks devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:nranks]), ("tp",))
    rows = PartitionSpec("tp")
    x = jax.device_put(jnp.ones((nranks, n), jnp.float32), NamedSharding(mesh, rows))

    def body(v):
        return fn(v[0], jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))[None]

    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows, out_specs=rows,
                                            check_vma=False))(x))


def test_the_applied_call_refuses_it():
    """In Python, where the config allows it (residual="local" with the default in-call update,
    passed to the applied call directly)."""
    cfg = ej.EchoConfig(bits=4, transport="p2p", residual="local")
    with pytest.raises(ValueError, match=r"p2p_allreduce_applied: EchoConfig.residual='local'"):
        _direct(lambda x, m1, m2: cpu.allreduce_applied(x, m1, m2, "tp", 2, cfg))


def test_the_handler_refuses_the_attribute_with_a_rotation_or_on_the_applied_call(monkeypatch):
    """The C++ handler's own check of residual_local = 1 (the Python side never passes it with
    either; here it is forced): an InvalidArgument error naming the attribute and the fix."""
    monkeypatch.setattr(cpu.base, "residual_local_attr", lambda config: 1)
    rotated = ej.EchoConfig(bits=4, transport="p2p", rotation="hadamard")
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"(?s)INVALID_ARGUMENT.*attribute 'residual_local' is 1 with "
                             r"rotate=1.*pass rotate=0"):
        _direct(lambda x, m1, m2: cpu.allreduce_compensated(x, m1, m2, "tp", 2, rotated)[0])
    plain = ej.EchoConfig(bits=4, transport="p2p")
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"(?s)INVALID_ARGUMENT.*attribute 'residual_local' is 1 on the "
                             r"applied call.*pass residual_local=0"):
        _direct(lambda x, m1, m2: cpu.allreduce_applied(x, m1, m2, "tp", 2, plain))
    # The group recovers: the next call of the same shapes runs.
    monkeypatch.undo()
    y = _direct(lambda x, m1, m2: cpu.allreduce_compensated(x, m1, m2, "tp", 2, plain)[0])
    assert np.all(np.abs(y - 2.0) < 0.1)


def test_a_call_that_cannot_fuse_it_refuses_with_the_fix():
    """The local residual exists only inside a protocol (the fused call's, or the "xla"
    transport's in JAX): a custom-call plan whose compensation would run in JAX around an
    uncompensated call raises, naming why and the fix, instead of feeding x' - y / P."""
    from echo_jax import transports
    from echo_jax.transports import cuda

    # The CPU call with the int8 state and g != 128 (a wire group is not a state group).
    cfg = ej.EchoConfig(group_size=64, state_dtype="int8", residual="local")
    with pytest.raises(ValueError, match=r"residual='local'.*group_size 128.*transport='xla'"):
        transports.plan_with(cpu.TRANSPORT, cfg, state_dtype="int8")
    # The CUDA call takes it with the int8 state only.
    cfg = ej.EchoConfig(residual="local")
    with pytest.raises(ValueError, match=r"residual='local'.*int8 or int4 state only"):
        transports.plan_with(cuda.TRANSPORT, cfg, state_dtype="float32")
    assert transports.plan_with(cuda.TRANSPORT, cfg.replace(state_dtype="int8"),
                                state_dtype="int8").compensation == "fused"
    # The "xla" transport runs it in JAX.
    assert transports.plan_with(transports.XLA, cfg, state_dtype="float32").compensation == "jax"
