"""The transport interface (echo_jax.transports), the one policy table, and import hygiene.

* every transport answers `unavailable_reason` (None where it can run, else a sentence), and
  `transports.select` is the one choice of "auto" / "p2p" / "xla" and the kill switch;
* `echo_psum` takes the fused compensated path because the chosen transport has
  `allreduce_compensated`, whatever its name;
* the policy table (echo_jax.policies) agrees with the C++ handlers and the wire-bits users;
* every echo_jax module imports on its own in a fresh interpreter, and `import echo_jax` does not
  import JAX.
"""

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
    for t in (xla, cpu, cuda):
        assert t.NAME in ("xla", "p2p")
        for name in ("unavailable_reason", "limit_reason", "allreduce"):
            assert callable(getattr(t, name)), (t.__name__, name)
    assert not transports.has_fused_compensation(xla)
    assert transports.has_fused_compensation(cpu) and transports.has_fused_compensation(cuda)


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
    assert transports.select(auto, "tp") is xla
    assert transports.select(pure, "tp") is xla
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
    assert seen["auto"] is cpu and seen["forced"] is cpu and seen["override"] is cpu
    assert seen["big"] is xla
    assert seen["names"] == ("p2p", "p2p")
    with pytest.raises(ValueError, match="group_size=131072 exceeds"):
        in_shard_map(lambda v: transports.select(big.replace(transport="p2p"), "tp", 1000))

    monkeypatch.setenv(transports.FORCE_XLA_ENV, "1")
    in_shard_map(lambda v: seen.update(env=transports.select(forced, "tp", 1000),
                                       explicit=transports.resolve(forced, "tp", honor_env=False)))
    assert seen["env"] is xla               # echo_psum honours the kill switch
    assert seen["explicit"] == "p2p"        # the explicit p2p entry points do not


# --------------------------------------------------------------------------------------------
# The fused compensated path is chosen by capability, not by the name "p2p"


def _fake_transport(fused: bool, calls: list):
    """A transport named "fake" that runs the xla transport and records what echo_psum calls."""

    def allreduce(x, axis, num_ranks, config, factor=None):
        calls.append("allreduce")
        return xla.allreduce(x, axis, num_ranks, config, factor=factor)

    def allreduce_compensated(x, m1, m2, axis, num_ranks, config, factor=None):
        calls.append("allreduce_compensated")
        k = compensator.Coefficients.from_config(config)
        state = compensator.CompensatorState(m1, m2)
        xp = compensator.apply_correction(x.astype(jnp.float32), state, k)
        y = xla.xla_allreduce_scaled(xp, axis, num_ranks, config, factor)
        new = compensator.update_state(xp, y, num_ranks, state, k)
        return y.astype(x.dtype), new.m1, new.m2

    t = types.SimpleNamespace(NAME="fake", unavailable_reason=lambda axis_name=None: None,
                              limit_reason=lambda *a: None, allreduce=allreduce)
    if fused:
        t.allreduce_compensated = allreduce_compensated
    return t


@pytest.mark.parametrize("fused", [True, False])
def test_fused_path_follows_the_capability(monkeypatch, fused):
    calls = []
    monkeypatch.setattr(transports, "select", lambda *a, **k: _fake_transport(fused, calls))
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
    monkeypatch.setattr(transports, "select", lambda *a, **k: _fake_transport(True, calls))
    x = jax.random.normal(jax.random.key(1), (2, 256))
    for cfg in (ej.EchoConfig(rotation="hadamard"), ej.EchoConfig(state_dtype="bfloat16")):
        calls.clear()
        jax.vmap(lambda v, c=cfg: ej.echo_psum(v, "tp", config=c, state=ej.init_state(v, c)),
                 axis_name="tp")(x)
        assert calls and "allreduce_compensated" not in calls, (cfg, calls)


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
