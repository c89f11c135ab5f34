"""Smoke tests of the end-to-end benchmark (`python -m models.bench_e2e`) on CPU fake devices.

Tiny sizes and iteration counts: they check the pipeline (modes, JSON fields, all-reduce share,
background load), not the speed.
"""

import json
import math

import jax
import pytest

import echo_jax as ej
from echo_jax_tools.provenance import device_name
from models import bench_e2e


def _finite_positive(v):
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        bench_e2e.main(["--help"])
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_bad_flags_are_usage_errors():
    for argv in (["--modes", "echo3"], ["--background-load", "150"]):
        with pytest.raises(SystemExit) as info:
            bench_e2e.main(argv)
        assert info.value.code == 2


def test_modes_name_bits_compensation_and_state_dtype():
    assert bench_e2e.parse_modes("echo4-comp-bf16state,echo4") == ["psum", "echo4-comp-bf16state",
                                                                  "echo4"]
    comm = bench_e2e._comm_for("echo4-comp-bf16state", 2, "auto")
    assert comm.echo.bits == 4 and comm.echo.compensated and comm.state_dtype == "bfloat16"
    comm = bench_e2e._comm_for("echo8-comp", 2, "auto")
    assert comm.echo.bits == 8 and comm.echo.compensated and comm.state_dtype == "float32"
    assert not bench_e2e._comm_for("echo4", 2, "auto").echo.compensated
    with pytest.raises(ValueError, match="bad mode 'echo4-bf16state'"):
        bench_e2e.parse_modes("echo4-bf16state")
    comm = bench_e2e._comm_for("echo4-comp-separate", 2, "auto")
    assert comm.echo.compensated and comm.echo.state_update == "separate"
    assert bench_e2e._comm_for("echo4-comp-bf16state-separate", 2, "auto").echo == \
        ej.EchoConfig(bits=4, state_dtype="bfloat16", state_update="separate")
    assert bench_e2e._comm_for("echo4-comp", 2, "auto").echo.state_update == "in_call"
    with pytest.raises(ValueError, match="bad mode 'echo4-separate'"):
        bench_e2e.parse_modes("echo4-separate")


def test_background_load_runs_at_its_duty_cycle():
    import time
    with bench_e2e.BackgroundLoad(0.5, jax.devices()[:2], 1 << 16, period_s=0.02) as bg:
        time.sleep(0.3)
    assert bg.copies > 0 and 0.0 < bg.measured_duty <= 1.0
    with bench_e2e.BackgroundLoad(1.0, jax.devices()[:1], 1 << 16) as bg:
        time.sleep(0.1)
    assert bg.copies > 0 and bg.measured_duty > 0.5
    with bench_e2e.BackgroundLoad(0.0, jax.devices()[:1], 1 << 16) as bg:
        pass
    assert bg.copies == 0


@pytest.mark.slow
def test_e2e_tiny(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--preset", "tiny", "--tp", "2", "--batch", "1", "--seq", "8",
                         "--iters", "2", "--warmup", "1", "--background-load", "0,50",
                         "--background-mb", "1", "--json", str(out)])
    assert rc == 0
    assert "TTFT" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["tp"] == 2 and result["preset"] == "tiny" and result["machine"] == "cpu2"
    assert result["command"].startswith("python -m models.bench_e2e --preset tiny --tp 2 ")
    assert result["commit"] and result["device"] == device_name(jax.devices()[:2])
    assert result["allreduce_calls"] == dict(prefill=4, train_step=8,
                                             message_bytes_per_rank=1 * 8 * 64 * 4)
    assert "allreduce_share" in result["definitions"] and "timing" in result
    keys = {(r["load_pct"], r["mode"]) for r in result["rows"]}
    assert keys == {(load, m) for load in (0.0, 50.0)
                    for m in ("psum", "echo4-comp", bench_e2e.NO_ALLREDUCE)}
    none = {r["load_pct"]: r for r in result["rows"] if r["mode"] == bench_e2e.NO_ALLREDUCE}
    for r in result["rows"]:
        assert _finite_positive(r["ttft_s"]) and _finite_positive(r["step_s"])
        assert math.isfinite(r["final_loss"])
        if r["mode"] != bench_e2e.NO_ALLREDUCE:
            # The share as defined, against the no-all-reduce row at the same load. Its value is
            # timing noise at this size (a few ms on a shared CPU), so only the definition is
            # checked, not a range.
            base = none[r["load_pct"]]
            for t in ("ttft", "step"):
                want = (r[f"{t}_s"] - base[f"{t}_s"]) / r[f"{t}_s"]
                assert r[f"allreduce_share_{t}"] == pytest.approx(want, rel=1e-12)
                assert r[f"allreduce_share_{t}"] < 1.0
        if r["mode"] == "psum":
            assert r["speedup_step_vs_psum"] == 1.0
        if r["load_pct"] == 50.0:
            assert r["measured_load_pct"] > 0 and r["background_copies"] > 0
        else:
            assert r["measured_load_pct"] == 0.0
