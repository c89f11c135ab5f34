"""Smoke tests of the benchmark CLI (`python -m echo_jax_tools.bench`) on CPU fake devices.

Tiny sizes and iteration counts: they check the pipeline (rows, JSON fields, correctness columns,
plot, size gate), not the speed. The end-to-end benchmark is `models.bench_e2e`
(tests/models/test_bench_e2e.py); `bench e2e` only points there.
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from echo_jax.transports import cpu
from echo_jax_tools import bench, provenance

QUICK = ["--iters", "2", "--warmup", "1", "--repeats", "1"]
ROW_KEYS = ("row", "size_bytes", "ranks", "median_s", "speedup_vs_psum", "max_abs_err",
            "bit_identical_across_ranks")


def _finite_positive(v):
    return isinstance(v, float) and math.isfinite(v) and v > 0


@pytest.mark.parametrize("argv", [["--help"], ["allreduce", "--help"], ["gate", "--help"],
                                  ["kernels", "--help"], ["virtual", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_bad_flags_are_usage_errors(capsys):
    for argv in (["allreduce", "--sizes", "12XB"], ["allreduce", "--rows", "nccl"]):
        with pytest.raises(SystemExit) as info:
            bench.main(argv)
        assert info.value.code == 2
    assert bench.main(["allreduce", "--virtual", "--sizes", "64KB"] + QUICK) == 2
    assert "GPU" in capsys.readouterr().err


def test_e2e_points_to_the_models_command(capsys):
    assert bench.main(["e2e", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "python -m models.bench_e2e" in err and len(err.strip().splitlines()) == 1


def test_sizes_and_names():
    assert bench.parse_sizes("16MB,64KB,64KB") == [64 << 10, 16 << 20]
    assert bench.parse_sizes("small") == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    assert bench.parse_sizes("small,large")[-1] == 1 << 30
    assert bench.parse_size("1.5MB") == 3 << 19
    assert [bench.format_size(s) for s in (64 << 10, 1 << 20, 1 << 30, 1000)] == \
        ["64KB", "1MB", "1GB", "1000B"]
    cpu = jax.devices()[0]
    assert bench.machine_name(cpu, 8) == "cpu8"
    assert bench.machine_name(cpu, 4, simulated=True) == "cpu1-vmap4"

    class FakeGpu:
        platform, device_kind = "gpu", "NVIDIA H200"

    assert bench.machine_name(FakeGpu(), 4) == "h200x4"
    assert bench.machine_name(FakeGpu(), 4, virtual=True) == "h200x1-virtual4"


def test_time_op_stats():
    stats = bench.time_op_stats(lambda v: (v * 2.0, v + 1.0), jnp.ones(1024), iters=3,
                                repeats=2, warmup=1)
    assert len(stats["loop_s"]) == 2
    assert all(_finite_positive(stats[k]) for k in ("median_s", "min_s", "max_s"))
    assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]


def test_allreduce_all_rows_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "ar.json", tmp_path / "ar.png"
    rc = bench.main(["allreduce", "--sizes", "64KB", "--ranks", "4", "--gate", "--json",
                     str(out), "--png", str(png)] + QUICK)
    assert rc == 0
    table = capsys.readouterr().out
    assert "psum" in table and "speedup" in table
    result = json.loads(out.read_text())
    assert result["machine"] == "cpu4" and result["ranks"] == 4
    assert "fori_loop" in result["timing"]
    # The run records its command and the commit of its code (None outside a git checkout).
    assert result["command"] == ("python -m echo_jax_tools.bench allreduce --sizes 64KB --ranks 4 "
                                 f"--gate --json {out} --png {png} " + " ".join(QUICK))
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", result["commit"])
    assert result["device"] == provenance.device_name(jax.devices()[:4])   # the 4 ranks' devices
    expected = list(bench.ROWS) if "cpu" in cpu.available_platforms() else \
        ["psum", "xla8", "xla4"]
    assert [r["row"] for r in result["rows"]] == expected
    for r in result["rows"]:
        assert all(k in r for k in ROW_KEYS)
        assert r["size_bytes"] == 64 << 10 and r["ranks"] == 4
        assert _finite_positive(r["median_s"]) and _finite_positive(r["speedup_vs_psum"])
        assert r["bit_identical_across_ranks"] is True
        assert math.isfinite(r["max_abs_err"])
    rows = {r["row"]: r for r in result["rows"]}
    assert rows["psum"]["max_abs_err"] == 0.0 and rows["psum"]["speedup_vs_psum"] == 1.0
    assert 0 < rows["xla8"]["max_abs_err"] < 0.2 < rows["xla4"]["max_abs_err"] < 3.0
    if "p2p4-comp-fused" in rows:
        # Both transports and both compensator placements give the same bits.
        assert rows["p2p4"]["max_abs_err"] == rows["xla4"]["max_abs_err"]
        # rescale=True's power of two commutes with the quantizer: the unscaled call's bits
        # on normal data (no group near the 2^-100 scale floor or the 2^126 limit).
        assert rows["p2p4-rescale"]["max_abs_err"] == rows["p2p4"]["max_abs_err"]
        assert rows["p2p4-comp-unfused"]["max_abs_err"] == rows["p2p4"]["max_abs_err"]
        # A zero state in any format adds nothing: the sum of the plain call.
        assert rows["p2p4-comp-fused-int8state"]["max_abs_err"] == rows["p2p4"]["max_abs_err"]
        assert rows["p2p4-comp-fused"]["bit_identical_to_unfused"] is True
        assert rows["p2p4-comp-separate"]["bit_identical_to_fused"] is True
    assert result["gate"]["row"] in bench.GATE_ROWS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif("cpu" not in cpu.available_platforms(), reason="the CPU custom call")
@pytest.mark.parametrize("row", ["p2p4-comp-fused", "p2p4-comp-fused-bf16state",
                                 "p2p4-comp-fused-int8state-local"])
def test_the_timed_loop_updates_the_state_in_place(row):
    """The Table 2 program of a compensated mesh row (the call, then the next matmul, in the
    timed loop with the state carried) runs the fused call once in the loop body and copies no
    buffer there: XLA copies the carried state once, at entry. (With an int8 state's scales
    squeezed from [1, groups] blocks around the call, XLA copied both before and after every
    call, and the row timed those copies too.)"""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    with jax.set_mesh(mesh):
        fn, state_dtype = bench._mesh_rows(mesh, 4)[row]
        sharding = NamedSharding(mesh, PartitionSpec("tp"))
        x = jax.device_put(jnp.ones((4, 4096), jnp.bfloat16), sharding)
        m = bench.stored_state(jax.device_put(jnp.zeros((4, 4096), jnp.float32), sharding),
                               state_dtype, flat_scales=True)
        step = bench.with_next_matmul(fn, True, jnp.eye(1024, dtype=jnp.bfloat16))
        text = bench.timing_loop(step, carry_state=True).lower((x, m, m), 3).compile().as_text()
    computations = {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=\S)", text)}
    target = cpu.TARGET_COMPENSATED_Q8 if state_dtype == "int8" else cpu.TARGET_COMPENSATED
    bodies = [c for name, c in computations.items()
              if name != "ENTRY" and f'custom_call_target="{target}"' in c]
    assert len(bodies) == 1, "the fused call is not in exactly one loop body"
    called = [computations.get(n, "") for n in re.findall(r"calls=(%[\w.\-]+)", bodies[0])]
    copies = [ln.strip() for c in [bodies[0], *called] for ln in c.splitlines()
              if re.search(r"\bcopy(-start)?\(", ln)]
    assert not copies, f"the timed loop copies buffers every call: {copies}"


def test_allreduce_next_matmul_columns(tmp_path, capsys):
    """--next-matmul D: every row is also timed followed by the next layer's multiplication,
    and what it adds to the multiplication alone is reported (the Echo paper's Table 2 method):
    the median over the repeats of each loop's time minus that of the multiplication's own loop
    timed right before it, recomputed here from the loops the JSON records."""
    out = tmp_path / "mm.json"
    rows = "p2p4,p2p4-comp-fused,p2p4-comp-separate"
    rc = bench.main(["allreduce", "--sizes", "64KB", "--ranks", "4", "--rows", rows,
                     "--next-matmul", "64", "--json", str(out), "--no-plot",
                     "--iters", "2", "--warmup", "1", "--repeats", "3"])
    assert rc == 0
    assert "beside the next matmul (D=64)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert any("next layer's multiplication" in n for n in result["notes"])
    for r in result["rows"]:
        assert r["next_matmul_dim"] == 64
        assert _finite_positive(r["with_next_matmul_s"]) and _finite_positive(r["next_matmul_s"])
        both, alone = r["with_next_matmul_loop_s"], r["next_matmul_loop_s"]
        assert len(both) == len(alone) == len(r["loop_s"]) == 3
        assert r["with_next_matmul_s"] == float(np.median(both))
        assert r["next_matmul_s"] == float(np.median(alone))
        assert r["added_to_next_matmul_s"] == pytest.approx(
            float(np.median(np.subtract(both, alone))), rel=1e-12)
    # A size whose values a rank are not a multiple of D is refused, naming the flag.
    rc = bench.main(["allreduce", "--sizes", "64KB", "--ranks", "4", "--rows", "p2p4",
                     "--next-matmul", "96", "--json", str(out), "--no-plot"] + QUICK)
    assert rc == 2
    assert "--next-matmul 96" in capsys.readouterr().err


def test_compare_against_numpy():
    """The benchmark's correctness columns come from `_compare`: its error is NumPy's max |y -
    ref| and its bit identity catches a single ulp on a single rank (fp32 and bf16)."""
    import numpy as np

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 1000)).astype(np.float32)
    y = np.repeat(ref[:1] + rng.standard_normal((1, 1000)).astype(np.float32) * 0.01, 4, axis=0)
    err, same = (np.asarray(v) for v in bench._compare(jnp.asarray(y), jnp.asarray(ref)))
    want = np.abs(y.astype(np.float64) - ref.astype(np.float64)).max()
    assert float(err) == pytest.approx(want, rel=1e-6) and bool(same)
    for dtype in (jnp.float32, jnp.bfloat16):
        yd = jnp.asarray(y).astype(dtype)
        bad = yd.at[2, 517].set(jnp.nextafter(yd[2, 517], jnp.asarray(np.inf, dtype)))
        assert bool(bench._compare(yd, jnp.asarray(ref))[1])
        assert not bool(bench._compare(bad, jnp.asarray(ref))[1])
        assert not bool(bench._compare(yd.at[0, 0].set(-yd[0, 0]), jnp.asarray(ref))[1])


def test_fused_and_unfused_rows_agree_bit_for_bit():
    """The claim behind bit_identical_to_unfused, checked here rather than read from the row:
    the fused and unfused compensated rows give the same result and state bits, from a zero and
    from a live state, and every rank the same result."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    if "cpu" not in cpu.available_platforms():
        pytest.skip("the CPU custom call is not built")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, PS("tp")))  # noqa: E731
    with jax.set_mesh(mesh):
        table = bench._mesh_rows(mesh, 4)
        x = put(np.random.default_rng(1).standard_normal((4, 3000)).astype(np.float32))
        state = (put(np.zeros((4, 3000), np.float32)),) * 2
        for _ in range(2):
            fused = [np.asarray(a) for a in table["p2p4-comp-fused"][0]((x, *state))]
            unfused = [np.asarray(a) for a in table["p2p4-comp-unfused"][0]((x, *state))]
            for a, b in zip(fused, unfused):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
            assert all(np.array_equal(fused[0][0].view(np.uint32), fused[0][r].view(np.uint32))
                       for r in range(4))
            state = (put(fused[1]), put(fused[2]))   # then from the live state
        assert np.abs(fused[1]).max() > 0


def test_allreduce_row_choice_default_paths_and_bf16(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = bench.main(["allreduce", "--sizes", "64KB", "--ranks", "2", "--rows", "xla4",
                     "--dtype", "bfloat16"] + QUICK)
    assert rc == 0
    result = json.loads((tmp_path / "results" / "bench_allreduce_cpu2.json").read_text())
    assert (tmp_path / "results" / "bench_allreduce_cpu2.png").exists()
    assert [r["row"] for r in result["rows"]] == ["psum", "xla4"]  # psum always: the reference
    assert all(r["dtype"] == "bfloat16" and r["bit_identical_across_ranks"]
               for r in result["rows"])


def test_sizes_over_the_memory_budget_are_skipped(tmp_path):
    out = tmp_path / "big.json"
    assert bench.main(["allreduce", "--sizes", "4096GB", "--ranks", "2", "--json", str(out)]
                      + QUICK) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == [] and result["skipped_sizes"][0]["size_bytes"] == 4096 << 30


def _rows(speedups):
    out = []
    for size, s in speedups.items():
        out += [dict(row="psum", size_bytes=size, speedup_vs_psum=1.0),
                dict(row="p2p4", size_bytes=size, speedup_vs_psum=s)]
    return out


def test_derive_gate():
    # Faster from 1 MB on (a dip below 1 at 256 KB after a win at 64 KB does not count).
    g = bench.derive_gate(_rows({64 << 10: 1.1, 256 << 10: 0.9, 1 << 20: 1.2, 4 << 20: 2.0}),
                          "p2p4")
    assert g["min_bytes"] == 1 << 20
    assert bench.derive_gate(_rows({64 << 10: 1.5, 1 << 20: 2.0}), "p2p4")["min_bytes"] == 64 << 10
    never = bench.derive_gate(_rows({64 << 10: 0.5, 1 << 20: 0.9}), "p2p4")
    assert never["min_bytes"] is None and "larger" in never["note"]
    assert bench.derive_gate(_rows({64 << 10: 1.0}), "xla4")["min_bytes"] is None


def test_gate_command(tmp_path):
    out = tmp_path / "gate.json"
    rc = bench.main(["gate", "--sizes", "64KB,256KB", "--ranks", "2", "--rows", "xla4",
                     "--json", str(out), "--no-plot"] + QUICK)
    assert rc == 0
    result = json.loads(out.read_text())
    gate = result["gate"]
    assert gate["row"] == "xla4" and set(gate["per_row"]) == {"xla4"}
    assert gate["min_bytes"] is None or gate["min_bytes"] in (64 << 10, 256 << 10)
    assert not (tmp_path / "gate.png").exists()


def test_byte_floor_against_hand_counted_bytes():
    # P = 4 ranks, fp32, 4 bits, g = 128, asym: w = 0.5 + 4 / 128 = 0.53125 B a value. Per rank
    # and value: x read + y written (8 B), codes written by the push (3/4 w), read by the reduce
    # (3/4 w), written by the gather into all 4 slots (w), read by the tail (3/4 w).
    n = 1 << 20
    per_value = 8 + 0.53125 * (0.75 + 0.75 + 1 + 0.75)
    assert bench.byte_floor("p2p4", n, 4, 4) == round(per_value * n * 4)
    assert bench.byte_floor("xla4", n, 4, 4) == bench.byte_floor("p2p4", n, 4, 4)
    # 8 bits: w = 1 + 4 / 128; bf16 at P = 2: x and y 2 B each.
    assert bench.byte_floor("p2p8", n, 2, 2) == round((4 + 1.03125 * (0.5 * 3 + 1)) * n * 2)
    # The fused compensator adds m1, m2 read (8), x, m1, m2 read again (4 + 8), m1, m2 written
    # (8); the own segment's quarter of the values skips the second read (12 / 4).
    assert bench.byte_floor("p2p4-comp-fused", n, 4, 4) == round((per_value + 25) * n * 4)
    # A bf16 state halves the state's 24 B: 12 B + x read again, less (4 + 4) / 4.
    assert bench.byte_floor("p2p4-comp-fused-bf16state", n, 4, 4) == round((per_value + 14) * n * 4)
    # The separate update re-reads everything, and y: 28 + 4.
    assert bench.byte_floor("p2p4-comp-separate", n, 4, 4) == round((per_value + 32) * n * 4)
    assert bench.byte_floor("psum", n, 4, 4) == 2 * 4 * n * 4
    # The rescaled row reads x once more for its max.
    assert bench.byte_floor("p2p4-rescale", n, 4, 4) == round((per_value + 4) * n * 4)


def test_time_op_stats_calls_per_iteration():
    # K calls an iteration on K different inputs: XLA keeps all K (identical inputs would let it
    # merge them into one call and report a K-times too short time).
    xs = tuple(jnp.arange(1024, dtype=jnp.float32) + i for i in range(4))
    hlo = bench.timing_loop(jnp.sin).lower(xs, 3).compile().as_text()
    assert len(re.findall(r"= f32\[1024\]\{0\} sine\(", hlo)) == 2 * 4  # first call + loop body
    stats = bench.time_op_stats(jnp.sin, jnp.ones(1024), iters=3, repeats=2, warmup=1,
                                calls_per_iteration=4)
    assert all(_finite_positive(stats[k]) for k in ("median_s", "min_s", "max_s"))
    with pytest.raises(ValueError, match="carry_state"):
        bench.time_op_stats(lambda v: v, (jnp.ones(8),) * 3, 1, 1, carry_state=True,
                            calls_per_iteration=2)


def test_update_floor_has_a_help_and_needs_a_gpu_only_to_run():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "echo_jax_tools.update_floor", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "byte floor" in out.stdout and "--json" in out.stdout
