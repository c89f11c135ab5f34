"""The transport interface (echo_jax.transports), the one policy table, and import hygiene.

* every transport answers `unavailable_reason` (None where it can run, else a sentence), and
  `transports.select` is the one choice of "auto" / "p2p" / "xla" and the kill switch;
* `echo_psum` takes the fused compensated path because the chosen transport has
  `allreduce_compensated`, whatever its name;
* the policy table (echo_jax.policies) agrees with the C++ handlers and the wire-bits users;
* every echo_jax module imports on its own in a fresh interpreter, and `import echo_jax` does not
  import JAX.
"""

import dataclasses
import os
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from conftest import make_mesh, put
from echo_jax import collective, compensator, policies, transports
from echo_jax.transports import cpu, cuda, xla

REPO = Path(__file__).resolve().parents[2]


def in_shard_map(fn, num_ranks=2):
    """Runs fn(v) for its side effects while tracing inside a shard_map over 'tp'."""
    mesh = make_mesh((num_ranks,), ("tp",))
    jax.jit(jax.shard_map(lambda v: (fn(v), v)[1], mesh=mesh, in_specs=P("tp"),
                          out_specs=P("tp")))(put(np.zeros(2 * num_ranks, np.float32), mesh,
                                                  P("tp")))


def in_vmap(fn):
    """Runs fn(v) for its side effects while tracing inside jax.vmap over 'i'."""
    jax.vmap(lambda v: (fn(v), v)[1], axis_name="i")(jnp.zeros((2, 3)))


def needs_cpu_call():
    if "cpu" not in cpu.available_platforms():
        pytest.skip("the CPU custom call is not built")


# --------------------------------------------------------------------------------------------
# Each transport's unavailable_reason


def test_every_transport_has_the_interface():
    for module in (xla, cpu, cuda):
        t = module.TRANSPORT
        assert isinstance(t, transports.base.Transport)
        assert t.name == module.NAME in ("xla", "p2p")
        assert t.custom_call == (module is not xla)
    assert (transports.XLA, transports.CPU, transports.CUDA) == (
        xla.TRANSPORT, cpu.TRANSPORT, cuda.TRANSPORT)
    assert not transports.has_fused_compensation(transports.XLA)
    assert transports.has_fused_compensation(transports.CPU)
    assert transports.has_fused_compensation(transports.CUDA)
    # The interface is abstract: a transport must say when it runs and how it reduces.
    with pytest.raises(TypeError, match="abstract"):
        transports.base.Transport()


def test_xla_is_available_everywhere():
    assert xla.unavailable_reason() is None
    assert xla.unavailable_reason("tp") is None
    assert xla.limit_reason(ej.EchoConfig(group_size=1 << 20), 2 ** 40, 1000) is None
    seen = {}
    in_vmap(lambda v: seen.update(vmap=xla.unavailable_reason("i")))
    assert seen["vmap"] is None


def test_cpu_reasons_outside_and_inside_shard_map():
    needs_cpu_call()
    outside = cpu.unavailable_reason("tp")
    assert isinstance(outside, str) and "shard_map" in outside
    seen = {}
    in_vmap(lambda v: seen.update(vmap=cpu.unavailable_reason("i")))
    assert isinstance(seen["vmap"], str) and "vmap" in seen["vmap"]
    in_shard_map(lambda v: seen.update(inside=cpu.unavailable_reason("tp"),
                                       other=cpu.unavailable_reason("dp")))
    assert seen["inside"] is None
    assert "not a manual axis" in seen["other"]
    assert "ranks" in cpu.limit_reason(ej.EchoConfig(), 100, cpu.MAX_RANKS + 1)


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="checks a CPU-only run")
def test_cuda_reason_on_cpu():
    seen = {}
    in_shard_map(lambda v: seen.update(inside=cuda.unavailable_reason("tp")))
    assert isinstance(seen["inside"], str) and "GPU" in seen["inside"], seen
    assert "ranks" in cuda.limit_reason(ej.EchoConfig(), 100, cuda.MAX_RANKS + 1)


# --------------------------------------------------------------------------------------------
# The one choice: transports.select


def test_select_outside_shard_map():
    auto, forced, pure = (ej.EchoConfig(transport=t) for t in ("auto", "p2p", "xla"))
    assert transports.select(auto, "tp") is transports.XLA
    assert transports.select(pure, "tp") is transports.XLA
    with pytest.raises(ValueError, match="EchoConfig.transport='p2p' cannot run here"):
        transports.select(forced, "tp")
    with pytest.raises(ValueError, match="^p2p_allreduce: EchoConfig.transport='p2p'"):
        transports.select(forced, "tp", where="p2p_allreduce")
    # The names the older entry points return are select's.
    assert collective.resolve_transport(auto, "tp") == "xla"
    assert transports.resolve(auto, "tp", honor_env=False) == "xla"


def test_select_inside_shard_map_and_the_kill_switch(monkeypatch):
    needs_cpu_call()
    auto, forced = ej.EchoConfig(), ej.EchoConfig(transport="p2p")
    big = ej.EchoConfig(group_size=1 << 17)
    seen = {}

    def probe(v):
        seen["auto"] = transports.select(auto, "tp", 1000)
        seen["forced"] = transports.select(forced, "tp", 1000)
        seen["big"] = transports.select(big, "tp", 1000)       # beyond the call's limit: xla
        seen["override"] = transports.select(ej.EchoConfig(transport="xla"), "tp",
                                             transport="auto")
        seen["names"] = (collective.resolve_transport(auto, "tp", 1000),
                         transports.resolve(auto, "tp", honor_env=False))

    in_shard_map(probe)
    assert seen["auto"] is seen["forced"] is seen["override"] is transports.CPU
    assert seen["big"] is transports.XLA
    assert seen["names"] == ("p2p", "p2p")
    with pytest.raises(ValueError, match="group_size=131072 exceeds"):
        in_shard_map(lambda v: transports.select(big.replace(transport="p2p"), "tp", 1000))

    monkeypatch.setenv(transports.FORCE_XLA_ENV, "1")
    in_shard_map(lambda v: seen.update(env=transports.select(forced, "tp", 1000),
                                       explicit=transports.resolve(forced, "tp", honor_env=False)))
    assert seen["env"] is transports.XLA    # echo_psum honours the kill switch
    assert seen["explicit"] == "p2p"        # the explicit p2p entry points do not


# --------------------------------------------------------------------------------------------
# The fused compensated path is chosen by capability, not by the name "p2p"


class _FakeTransport(transports.base.Transport):
    """A custom-call-like transport that runs the xla transport and records what echo_psum
    calls; with `fused`, it has a fused compensated call (fp32 state only)."""

    name = "fake"
    custom_call = True

    def __init__(self, fused: bool, calls: list):
        self.calls = calls
        self.fused_state_dtypes = ("float32",) if fused else ()

    def unavailable(self, axis_name=None, platform=None, devices=None):
        return None

    def limit_reason(self, config, num_elements, num_ranks):
        return None

    def allreduce(self, x, axis, num_ranks, config, factor=None):
        self.calls.append("allreduce")
        return xla.allreduce(x, axis, num_ranks, config, factor=factor)

    def allreduce_compensated(self, x, m1, m2, axis, num_ranks, config, factor=None):
        self.calls.append("allreduce_compensated")
        k = compensator.Coefficients.from_config(config)
        state = compensator.CompensatorState(m1, m2)
        xp = compensator.apply_correction(x.astype(jnp.float32), state, k)
        y = xla.xla_allreduce_scaled(xp, axis, num_ranks, config, factor)
        new = compensator.update_state(xp, y, num_ranks, state, k)
        return y.astype(x.dtype), new.m1.reshape(m1.shape), new.m2.reshape(m2.shape)


def _use(monkeypatch, transport):
    """Makes every plan choose `transport` (the transport choice `plan` makes once)."""
    monkeypatch.setattr(transports, "_decide", lambda *a, **k: (transport, None))


@pytest.mark.parametrize("fused", [True, False])
def test_fused_path_follows_the_capability(monkeypatch, fused):
    calls = []
    _use(monkeypatch, _FakeTransport(fused, calls))
    cfg = ej.EchoConfig()
    x = jax.random.normal(jax.random.key(0), (2, 300))

    def f(v):
        return ej.echo_psum(v, "tp", config=cfg, state=ej.init_state(v), rescale=False)

    y, state = jax.vmap(f, axis_name="tp")(x)
    want = "allreduce_compensated" if fused else "allreduce"
    assert calls and set(calls) == {want}, calls
    # Either path gives the bits of the xla transport.
    monkeypatch.undo()
    ref_y, ref_state = jax.vmap(f, axis_name="tp")(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref_y))
    np.testing.assert_array_equal(np.asarray(state.m1), np.asarray(ref_state.m1))


def test_rotation_and_bf16_state_stay_unfused(monkeypatch):
    calls = []
    _use(monkeypatch, _FakeTransport(True, calls))
    x = jax.random.normal(jax.random.key(1), (2, 256))
    for cfg in (ej.EchoConfig(rotation="hadamard"), ej.EchoConfig(state_dtype="bfloat16")):
        calls.clear()
        jax.vmap(lambda v, c=cfg: ej.echo_psum(v, "tp", config=c, state=ej.init_state(v, c)),
                 axis_name="tp")(x)
        assert calls and "allreduce_compensated" not in calls, (cfg, calls)


# --------------------------------------------------------------------------------------------
# The call plan: decided once per call site


def _count_decisions(monkeypatch):
    """Counts the transport decisions (`transports._decide`, behind `select` and `plan`)."""
    seen = []
    real = transports._decide

    def counting(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(transports, "_decide", counting)
    return seen


@pytest.mark.parametrize("cfg", [
    ej.EchoConfig(),
    ej.EchoConfig(rotation="hadamard"),
    ej.EchoConfig(state_update="separate"),
    ej.EchoConfig(transport="xla", rotation="hadamard"),
], ids=["plain", "rotated", "separate", "xla-rotated"])
def test_the_plan_is_made_once_per_call_site(monkeypatch, cfg):
    needs_cpu_call()
    seen = _count_decisions(monkeypatch)
    mesh = make_mesh((4,), ("tp",))
    x = put(np.arange(4 * 512, dtype=np.float32).reshape(4, 512) / 100.0, mesh, P("tp"))

    def site(v):
        y, st = ej.echo_psum(v, "tp", config=cfg, state=ej.init_state(v, axis_name="tp"))
        z = ej.echo_psum(y * 0.5, "tp", config=cfg)  # a second site: a second plan
        return y + z, st.m1

    def loss(v):
        out, m1 = jax.shard_map(site, mesh=mesh, in_specs=P("tp"),
                                out_specs=(P("tp"), P("tp")))(v)
        return jnp.sum(out ** 2) + jnp.sum(m1)

    jax.jit(loss).lower(x)
    assert len(seen) == 2, seen  # one decision per call site, none inside the call
    seen.clear()
    jax.jit(jax.grad(loss)).lower(x)  # the derivative rules re-trace the calls, not the plan
    assert len(seen) == 2, seen


def test_the_plan_names_every_choice_and_fallback():
    needs_cpu_call()
    got = {}

    def probe(v):
        got["fused"] = transports.plan(ej.EchoConfig(), "tp", 1000, state_dtype="float32")
        got["scaled"] = transports.plan(ej.EchoConfig(), "tp", 1000, state_dtype="float32",
                                        rescale=True)
        got["rot"] = transports.plan(ej.EchoConfig(rotation="hadamard"), "tp", 1000)
        got["xla"] = transports.plan(ej.EchoConfig(transport="xla", rotation="hadamard"), "tp",
                                     1000, state_dtype="float32", rescale=False)
        got["big"] = transports.plan(ej.EchoConfig(group_size=1 << 17), "tp", 1000)

    in_shard_map(probe)
    fused, rot, pure, big = got["fused"], got["rot"], got["xla"], got["big"]
    assert (fused.transport, fused.compensation, fused.update, fused.direct) == (
        transports.CPU, "fused", "in_call", True)
    # The default rescale ("auto") takes no factor; rescale=True's is an operand of the call.
    assert fused.factor_in == "none" and fused.reasons == ()
    assert got["scaled"].factor_in == "call" and got["scaled"].compensation == "fused"
    assert (rot.rotation, rot.config.rotation, rot.compensation) == ("call", "hadamard", "none")
    assert (pure.transport, pure.rotation, pure.compensation, pure.direct) == (
        transports.XLA, "jax", "jax", False)
    assert pure.config.rotation == "none" and pure.factor_in == "none"
    assert big.transport is transports.XLA
    assert big.reasons and "group_size=131072 exceeds" in big.reasons[0]
    assert "not the custom call" in big.describe()
    # Frozen and hashable: a static argument of the functions that trace the call.
    assert hash(fused) == hash(dataclasses.replace(fused))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fused.rotation = "jax"


# --------------------------------------------------------------------------------------------
# The policy table


def test_policy_table():
    assert policies.NAMES == ("asym", "sym", "asym_naive")
    assert policies.CODES == {"asym": 0, "sym": 1, "asym_naive": 2}
    assert cpu.POLICY_CODES == cuda.POLICY_CODES == policies.CODES
    assert ej.quant.POLICIES == ej.config.POLICIES == policies.NAMES
    assert [policies.num_params(p) for p in policies.NAMES] == [2, 1, 2]
    assert policies.BY_LABEL["naive"] == "asym_naive"
    for name in policies.NAMES:
        cfg = ej.EchoConfig(policy=name, group_size=64)
        label = ej.site_config_label(cfg)
        assert ej.parse_site_config(label).policy == name
        for bits in (4, 8):
            c = cfg.replace(bits=bits)
            want = policies.wire_bits_per_element(bits, 64, name)
            assert c.wire_bits_per_element == ej.site_wire_bits(c) == want
            assert ej.quant.wire_bytes_per_group(64, bits, name) * 8 / 64 == want
    with pytest.raises(ValueError, match="policy must be one of"):
        policies.num_params("fp4")


def test_cpp_format_check_reads_the_table():
    needs_cpu_call()
    from echo_jax import _ffi
    x = np.zeros((2, 8), np.float32)  # [groups, g]
    for code in policies.CODES.values():
        _ffi.quantize_groups(x, 4, code)
    with pytest.raises(ValueError, match=f"policy code .* got {len(policies.NAMES)}"):
        _ffi.quantize_groups(x, 4, len(policies.NAMES))
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        _ffi.quantize_groups(x, 3, 0)


# --------------------------------------------------------------------------------------------
# Imports


def _modules():
    import echo_jax
    names = []
    for info in pkgutil.walk_packages(echo_jax.__path__, "echo_jax."):
        if info.name.rsplit(".", 1)[-1] in ("__main__", "_ffi", "_ffi_cuda"):
            continue
        names.append(info.name)
    return sorted(names)


def _python(code):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_every_module_imports_alone():
    modules = _modules()
    assert {"echo_jax.collective", "echo_jax.p2p", "echo_jax.p2p_cuda", "echo_jax.policies",
            "echo_jax.transports.cpu", "echo_jax.transports.cuda"} <= set(modules)
    # One fresh interpreter per module: an import cycle shows only when its module comes first.
    failed = {}
    for name in modules:
        proc = _python(f"import {name}")
        if proc.returncode:
            failed[name] = proc.stderr[-2000:]
    assert not failed, failed


def test_import_echo_jax_does_not_import_jax():
    proc = _python(
        "import sys, echo_jax as ej\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
        "assert ej.__version__ and set(ej.__all__) <= set(dir(ej))\n"
        "import echo_jax.policies, echo_jax.config\n"
        "assert 'jax' not in sys.modules, 'policies / config import jax'\n"
        "for name in ej.__all__:\n"
        "    getattr(ej, name)\n"
        "assert 'jax' in sys.modules\n"
        "try:\n"
        "    ej.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
