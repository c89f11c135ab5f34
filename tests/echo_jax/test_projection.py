"""The multi-GPU projection (`echo_jax_tools.projection`, `python -m echo_jax_tools.bench project`).

The formulas against hand-computed values, the model's monotonicity, the measured-JSON paths and
the command line. No GPU: the module is pure Python + NumPy.
"""

import json
import os

import pytest

from echo_jax_tools import bench
from echo_jax_tools import projection as pj

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, pj.DEFAULT_KERNELS_JSON)
ALLREDUCE = os.path.join(ROOT, pj.DEFAULT_ALLREDUCE_JSON)
GiB, MiB = 1 << 30, 1 << 20


def _default_eff():
    return pj.load_efficiency(None, None)


# --------------------------------------------------------------------------------------------
# Formulas


def test_wire_bytes_and_ideal_ratio():
    assert pj.wire_bytes_per_element(4, 128, "asym") == 0.5 + 4 / 128 == 0.53125  # 68 B / 128
    assert pj.wire_bytes_per_element(4, 128, "sym") == 0.5 + 2 / 128
    assert pj.wire_bytes_per_element(8, 128, "asym") == 1.03125
    assert pj.wire_bytes_per_element(4, 64, "asym") == 0.5625
    # The paper's ideal byte ratio at 4 bits, g = 128: 16 / (4 + 32/128) = 3.7647.
    assert pj.ideal_byte_ratio(4, 128) == pytest.approx(16 / 4.25)
    assert round(pj.ideal_byte_ratio(4, 128), 2) == 3.76
    assert pj.ideal_byte_ratio(8, 128) == pytest.approx(16 / 8.25)


def test_ring_time_hand_computed():
    # P = 4, 1 GiB, 200 GB/s, 2 us: 2 * 3/4 * 2^30 / 200e9 + 6 * 2e-6.
    t = pj.ring_allreduce_time(GiB, 4, 200.0, 2.0)
    assert t == pytest.approx(1.5 * 2**30 / 200e9 + 12e-6, rel=1e-12)
    assert t * 1e3 == pytest.approx(8.0653, abs=1e-3)
    assert pj.ring_allreduce_time(GiB, 1, 200.0, 2.0) == 0.0
    # P = 8: factor 2 * 7/8 = 1.75 and 14 latencies.
    assert pj.ring_allreduce_time(GiB, 8, 200.0, 2.0) == pytest.approx(
        1.75 * 2**30 / 200e9 + 28e-6, rel=1e-12)


def test_a100_preset_reproduces_the_paper_nccl_time():
    link = pj.PRESETS["a100-nvlink3"]
    t = pj.ring_allreduce_time(GiB, 4, link.nccl_busbw_gbps, link.latency_us)
    assert t * 1e3 == pytest.approx(pj.PAPER_A100_P4_1GB["nccl_ms"], abs=0.02)
    assert link.link_gbps == 300.0 and pj.PRESETS["h200-nvlink4"].link_gbps == 450.0


def test_echo_link_time_hand_computed():
    # 2^28 values, P = 4, w = 0.53125, 300 GB/s at efficiency 0.5.
    t = pj.echo_link_time(2**28, 4, 0.53125, 300.0, 0.5)
    assert t == pytest.approx(1.5 * 2**28 * 0.53125 / 150e9, rel=1e-12)
    # 4-bit link time against the 16-bit ring at equal bandwidth: the ideal ratio.
    ring = pj.ring_allreduce_time(2**28 * 2, 4, 300.0, 0.0)
    assert ring / pj.echo_link_time(2**28, 4, 0.53125, 300.0) == pytest.approx(16 / 4.25)


def test_stage_bytes_sum():
    for P in (2, 4, 8):
        for e in (2, 4):
            w = 0.53125
            st = pj.p2p_stage_bytes(e, w, P)
            assert set(st) == {"push", "reduce", "tail"}
            assert sum(st.values()) == pytest.approx(2 * e + 4 * (P - 1) / P * w)
    # fp32, P = 4, 4-bit: 8 + 3 * 0.53125.
    assert sum(pj.p2p_stage_bytes(4, 0.53125, 4).values()) == pytest.approx(9.59375)
    # xla: 2e + 3w + (e + 8 + w)/P; fp32, P = 4: 8 + 1.59375 + 12.53125 / 4.
    assert pj.xla_bytes(4, 0.53125, 4) == pytest.approx(8 + 1.59375 + 12.53125 / 4)


def test_compensator_extra_bytes():
    assert pj.compensator_extra_bytes(4, 4) == 28   # fp32 x, fp32 state: the design's 28 B
    assert pj.compensator_extra_bytes(2, 4) == 26   # bf16 x, fp32 state
    assert pj.compensator_extra_bytes(2, 2) == 14   # bf16 x, bf16 state


def test_pipelined_time():
    t = pj.pipelined_time(3e-3, 1e-3, 100, 2, 1.0)
    assert t["overlapped"] == pytest.approx(3e-3 + 1e-3 / 100 + 4e-6)
    assert t["serial"] == pytest.approx(4e-3 + 4e-6)
    for L, H, k in ((1e-3, 5e-3, 1), (2e-3, 2e-3, 7), (0.0, 1e-3, 64), (9e-3, 1e-4, 3)):
        t = pj.pipelined_time(L, H, k, 1, 1.0)
        assert t["overlapped"] <= t["serial"] + 1e-15
        assert t["overlapped"] >= max(L, H)


def test_launch_plan_follows_the_kernel():
    # 1 GiB of bf16 at P = 4: 2^20 groups per segment, 128-group tiles (16384 values): 8192
    # tiles; a 32 MiB slot holds (2^25 - 64) // 68 // 128 = 3855 tiles: 3 chunks.
    assert pj.launch_plan(2**29, 4, 4) == (3855, 3)
    # 8 bits: 132 B per group, (2^25 - 64) // 132 // 128 = 1985 tiles a chunk: 5 chunks.
    assert pj.launch_plan(2**29, 4, 8) == (1985, 5)
    # A small message: >= 64 tiles per segment, one chunk.
    k, c = pj.launch_plan(4 * 128 * 64, 4, 4)
    assert (k, c) == (64, 1)


# --------------------------------------------------------------------------------------------
# The projection


def _rows(result):
    return {(r["preset"], r["ranks"], r["dtype"], r["size_bytes"], r["row"]): r
            for r in result["rows"]}


def test_project_default_model_by_hand():
    eff = _default_eff()
    link = pj.Link("t", link_gbps=100.0, latency_us=0.0, hbm_gbps=1000.0, nccl_busbw_gbps=80.0,
                   p2p_eff=1.0, device="none")
    r = pj.project_one(link, "p2p4", 256 * MiB, 4, "float32", eff)
    N = 64 * MiB
    L = 1.5 * N * 0.53125 / 100e9
    bw = 1000e9 * pj.DEFAULT_COPY_EFF * pj.DEFAULT_KERNEL_EFF
    H = N * 9.59375 / bw
    assert r["link_s"] == pytest.approx(L) and r["hbm_s"] == pytest.approx(H)
    assert r["serial_s"] == pytest.approx(L + H)
    assert r["overlapped_s"] == pytest.approx(max(L, H) + min(L, H) / r["tiles_per_chunk"])
    # No measured added time: the compensated rows are not projected from a byte count.
    for row in ("comp-fused", "comp-separate"):
        c = pj.project_one(link, row, 256 * MiB, 4, "float32", eff)
        assert c["overlapped_s"] is None and c["serial_s"] is None
        assert c["not_projected"].startswith("no measured added time")
    psum = pj.project_one(link, "psum", 256 * MiB, 4, "float32", eff)
    assert psum["overlapped_s"] == pytest.approx(1.5 * 256 * MiB / 80e9)
    x = pj.project_one(link, "xla4", 256 * MiB, 4, "float32", eff)
    assert x["overlapped_s"] == x["serial_s"] == pytest.approx(
        1.5 * N * 0.53125 / 80e9 + N * pj.xla_bytes(4, 0.53125, 4) / bw)


# A hand-made `bench allreduce --virtual --ranks 4 --dtype bfloat16 --next-matmul` JSON: one H100
# (3350 GB/s HBM), 64 MB and 256 MB a rank; p2p4-comp-separate has no added time at 256 MB.
HAND_COMMAND = "python -m echo_jax_tools.bench allreduce --virtual --next-matmul 4096 (by hand)"


def _hand_row(row, size, median, added=None, dtype="bfloat16"):
    r = dict(row=row, size_bytes=size, ranks=4, dtype=dtype, median_s=median)
    if added is not None:
        r.update(next_matmul_dim=4096, next_matmul_s=2e-3, with_next_matmul_s=2e-3 + added,
                 added_to_next_matmul_s=added)
    return r


def _hand_json(tmp_path, rows=None):
    rows = rows or [
        _hand_row("psum", 256 * MiB, 1.0e-3, 1.2e-3),
        _hand_row("p2p4", 64 * MiB, 0.40e-3, 0.45e-3),
        _hand_row("p2p4", 256 * MiB, 1.6e-3, 1.5e-3),
        _hand_row("p2p4-comp-fused", 64 * MiB, 1.2e-3, 1.30e-3),
        _hand_row("p2p4-comp-fused", 256 * MiB, 5.0e-3, 5.5e-3),
        _hand_row("p2p4-comp-separate", 64 * MiB, 4.0e-3, 3.9e-3),
        _hand_row("p2p4-comp-separate", 256 * MiB, 16.0e-3),
    ]
    path = tmp_path / "ar_hand.json"
    path.write_text(json.dumps({"benchmark": "allreduce", "command": HAND_COMMAND,
                                "commit": "abc1234", "device": "NVIDIA H100 80GB HBM3",
                                "ranks": 4, "dtype": "bfloat16", "rows": rows}))
    return path


HAND_LINK = pj.Link("t", link_gbps=300.0, latency_us=0.0, hbm_gbps=2000.0, nccl_busbw_gbps=180.0,
                    p2p_eff=0.8, device="none")


def test_compensated_row_is_p2p4_plus_the_measured_added_time(tmp_path):
    eff = pj.load_efficiency(None, str(_hand_json(tmp_path)))
    res = pj.project([HAND_LINK], [GiB], [4], ["bfloat16"], eff)
    rows = {r["row"]: r for r in res["rows"]}
    # p2p4 at 1 GiB of bf16, P = 4, by hand: N = 2^29 values; link 1.5 N w / (0.8 * 300 GB/s);
    # HBM from the nearest measured size (256 MB): the measured 1.6 ms moved 4 ranks' bytes, so
    # one rank of 4x the values takes 1.6 ms / 4 * 4, times the HBM ratio 3350 / 2000; tiles
    # of the launch plan at 1 GiB bf16, P = 4: 3855 a chunk.
    N = 2**29
    L = 1.5 * N * 0.53125 / (0.8 * 300e9)
    H = 1.6e-3 / 4 * 4 * 3350 / 2000
    p2p4 = max(L, H) + min(L, H) / 3855
    assert rows["p2p4"]["overlapped_s"] == pytest.approx(p2p4, rel=1e-9)
    # comp-fused: p2p4 plus (5.5 - 1.5) ms, the measured added time over p2p4's at 256 MB,
    # per virtual rank (/ 4), for 4x the values, at the HBM ratio; overlapping nothing.
    extra = (5.5e-3 - 1.5e-3) / 4 * 4 * 3350 / 2000
    fused = rows["comp-fused"]
    assert fused["extra_s"] == pytest.approx(extra, rel=1e-9)
    assert fused["overlapped_s"] == pytest.approx(p2p4 + extra, rel=1e-9)
    assert fused["serial_s"] == pytest.approx(L + H + extra, rel=1e-9)
    psum = 1.5 * GiB / 180e9
    assert fused["speedup_vs_psum"] == pytest.approx(psum / (p2p4 + extra), rel=1e-9)
    assert fused["measured_row"] == "p2p4-comp-fused" and fused["measured_size_bytes"] == 256 * MiB
    assert fused["added_s"] == 5.5e-3 and fused["p2p4_added_s"] == 1.5e-3
    # At 64 MB the nearest measured size is 64 MB; the extra scales with the values.
    res64 = pj.project([HAND_LINK], [64 * MiB], [4], ["bfloat16"], eff)
    f64 = next(r for r in res64["rows"] if r["row"] == "comp-fused")
    assert f64["extra_s"] == pytest.approx((1.30e-3 - 0.45e-3) / 4 * 3350 / 2000, rel=1e-9)
    # P does not change the extra (the compensator's work a rank does not depend on P).
    res8 = pj.project([HAND_LINK], [GiB], [8], ["bfloat16"], eff)
    f8 = next(r for r in res8["rows"] if r["row"] == "comp-fused")
    assert f8["extra_s"] == pytest.approx(extra, rel=1e-9)


def test_a_compensated_row_says_what_it_may_add_for_the_target(tmp_path):
    # The target 1.5x psum on HAND_LINK at 1 GiB, P = 4: the compensated row's projected time
    # may be psum / 1.5, so p2p4's projected time plus D, and D maps back to the measurement
    # (256 MB a rank, 4 virtual ranks, an H100's HBM) as D_m = D * 4 * (256 MB / 1 GiB) * 2000 /
    # 3350. A measurement that adds exactly that over p2p4 projects to 1.5x.
    rows = [_hand_row("psum", 256 * MiB, 1.0e-3, 1.2e-3),
            dict(_hand_row("p2p4", 256 * MiB, 1.6e-3, 1.5e-3), floor_s=1.0e-3),
            dict(_hand_row("p2p4-comp-fused", 256 * MiB, 5.0e-3, 5.5e-3), floor_s=2.5e-3)]
    eff = pj.load_efficiency(None, str(_hand_json(tmp_path, rows)))
    res = pj.project([HAND_LINK], [GiB], [4], ["bfloat16"], eff, target_speedup=1.5)
    assert res["target_speedup"] == 1.5
    by = {r["row"]: r for r in res["rows"]}
    fused, psum = by["comp-fused"], 1.5 * GiB / 180e9
    allowed = (psum / 1.5 - by["p2p4"]["overlapped_s"]) * 4 * (256 * MiB / GiB) * 2000 / 3350
    assert fused["extra_measured_at_target_s"] == pytest.approx(allowed, rel=1e-9)
    assert fused["extra_floor_measured_s"] == pytest.approx(1.5e-3, rel=1e-9)
    assert 0 < allowed < fused["extra_measured_s"]  # 4 ms added: short of 1.5x
    rows[2] = _hand_row("p2p4-comp-fused", 256 * MiB, 5.0e-3, 1.5e-3 + allowed)
    again = pj.project([HAND_LINK], [GiB], [4], ["bfloat16"], pj.load_efficiency(
        None, str(_hand_json(tmp_path, rows))), target_speedup=1.5)
    refit = next(r for r in again["rows"] if r["row"] == "comp-fused")
    assert refit["speedup_vs_psum"] == pytest.approx(1.5, rel=1e-9)
    assert refit["extra_floor_measured_s"] is None  # no floor_s in that JSON
    # A target p2p4 alone misses: no added time reaches it.
    far = pj.project([HAND_LINK], [GiB], [4], ["bfloat16"], eff, target_speedup=50.0)
    assert next(r for r in far["rows"]
                if r["row"] == "comp-fused")["extra_measured_at_target_s"] < 0


def test_the_h100_preset_takes_the_measured_added_time_unscaled(tmp_path):
    # The preset of the GPU the added times are measured on (an H100 SXM: NVLink4, 450 GB/s a
    # direction, 3.35 TB/s HBM3): the HBM ratio is 1, so the extra over p2p4 is the measured
    # one per virtual rank, for 4x the values of the 256 MB measurement.
    link = pj.PRESETS["h100-nvlink4"]
    assert (link.link_gbps, link.hbm_gbps, link.device) == (450.0, 3350.0, "H100")
    eff = pj.load_efficiency(None, str(_hand_json(tmp_path)))
    res = pj.project([link], [GiB], [4], ["bfloat16"], eff)
    fused = next(r for r in res["rows"] if r["row"] == "comp-fused")
    assert fused["extra_s"] == pytest.approx((5.5e-3 - 1.5e-3) / 4 * 4, rel=1e-9)


def test_a_row_without_measured_added_time_is_not_projected(tmp_path, capsys):
    path = _hand_json(tmp_path)
    eff = pj.load_efficiency(None, str(path))
    res = pj.project([HAND_LINK], [GiB], [4], ["bfloat16", "float32"], eff)
    rows = {(r["row"], r["dtype"]): r for r in res["rows"]}
    # comp-separate has an added time at 64 MB only: 1 GiB's nearest size with one is 64 MB.
    sep = rows[("comp-separate", "bfloat16")]
    assert sep["measured_size_bytes"] == 64 * MiB
    assert sep["extra_s"] == pytest.approx((3.9e-3 - 0.45e-3) / 4 * 16 * 3350 / 2000, rel=1e-9)
    # Nothing was measured in float32: neither compensated row is projected there.
    for row in ("comp-fused", "comp-separate"):
        r = rows[(row, "float32")]
        assert r["overlapped_s"] is None and r["speedup_vs_psum"] is None
        assert "no measured added time" in r["not_projected"]
    assert {(i["row"], i["dtype"]) for i in res["not_projected"]} == {
        ("comp-fused", "float32"), ("comp-separate", "float32")}
    # Without any added time for the separate row, it is not projected at any size.
    rows_wo = [_hand_row("p2p4", 256 * MiB, 1.6e-3, 1.5e-3),
               _hand_row("p2p4-comp-fused", 256 * MiB, 5.0e-3, 5.5e-3),
               _hand_row("p2p4-comp-separate", 256 * MiB, 16.0e-3)]
    eff2 = pj.load_efficiency(None, str(_hand_json(tmp_path, rows_wo)))
    res2 = pj.project([HAND_LINK], [64 * MiB, GiB], [4], ["bfloat16"], eff2)
    for r in res2["rows"]:
        if r["row"] == "comp-separate":
            assert r["overlapped_s"] is None and "no measured added time" in r["not_projected"]
        else:
            assert r["overlapped_s"] > 0
    text = pj.format_table(res2)
    assert "not projected: comp-separate (bfloat16): no measured added time" in text
    line = next(x for x in text.splitlines() if x.startswith("| t | 4 | bfloat16 | 1GB"))
    assert line.count("not projected") == 1
    # Without p2p4's added time no compensated row is projected (its extra is over p2p4's).
    rows_np = [_hand_row("p2p4", 256 * MiB, 1.6e-3),
               _hand_row("p2p4-comp-fused", 256 * MiB, 5.0e-3, 5.5e-3)]
    eff3 = pj.load_efficiency(None, str(_hand_json(tmp_path, rows_np)))
    r3 = pj.project_one(HAND_LINK, "comp-fused", GiB, 4, "bfloat16", eff3)
    assert r3["overlapped_s"] is None
    # A bf16 state picks its own measured row, here absent.
    r4 = pj.project_one(HAND_LINK, "comp-fused", GiB, 4, "bfloat16", eff, state_bytes=2.0)
    assert r4["overlapped_s"] is None and "p2p4-comp-fused-bf16state" in r4["not_projected"]
    # An int8 state (1 byte a value) picks its own row too; measured, it is projected from it.
    r5 = pj.project_one(HAND_LINK, "comp-fused", GiB, 4, "bfloat16", eff, state_bytes=1.0)
    assert r5["overlapped_s"] is None and "p2p4-comp-fused-int8state" in r5["not_projected"]
    rows_q8 = [_hand_row("p2p4", 256 * MiB, 1.6e-3, 1.5e-3),
               _hand_row("p2p4-comp-fused-int8state", 256 * MiB, 4.0e-3, 4.3e-3)]
    eff5 = pj.load_efficiency(None, str(_hand_json(tmp_path, rows_q8)))
    r6 = pj.measured_comp_extra(eff5, "comp-fused", GiB, "bfloat16", 2000.0, state_bytes=1.0)
    assert r6["measured_row"] == "p2p4-comp-fused-int8state"
    assert r6["extra_measured_s"] == pytest.approx(4.3e-3 - 1.5e-3, rel=1e-9)


def test_nothing_in_the_output_is_assumed_hidden(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for ar in (str(_hand_json(tmp_path)), ALLREDUCE, "none"):
        out = tmp_path / "p.json"
        assert bench.main(["project", "--allreduce-json", ar, "--json", str(out)]) == 0
        text = capsys.readouterr().out + out.read_text()
        assert "assumed hidden" not in text.lower() and "update_beside" not in text
        assert "hidden" not in text.lower()


def test_results_json_records_its_inputs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = _hand_json(tmp_path)
    out = tmp_path / "p.json"
    argv = ["project", "--preset", "a100-nvlink3", "--ranks", "4", "--sizes", "1GB",
            "--dtypes", "bfloat16", "--allreduce-json", str(path), "--json", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    # The projection's own command and commit, and its inputs' fields as the files have them.
    assert res["command"] == "python -m echo_jax_tools.bench " + " ".join(argv)
    assert "commit" in res
    assert res["inputs"]["allreduce_json"] == {
        "path": str(path), "command": HAND_COMMAND, "commit": "abc1234",
        "device": "NVIDIA H100 80GB HBM3"}
    with open(KERNELS) as f:
        kern = json.load(f)
    assert res["inputs"]["kernels_json"] == {
        "path": pj.DEFAULT_KERNELS_JSON, "command": kern.get("command"),
        "commit": kern.get("commit"), "device": kern["device"]}
    text = capsys.readouterr().out
    assert f"input allreduce_json: {path} (device NVIDIA H100 80GB HBM3, commit abc1234" in text
    # The stored virtual-rank JSON: its fields as the file has them (command and commit
    # backfilled from results/README.md, the device as the run wrote it).
    with open(ALLREDUCE) as f:
        stored = json.load(f)
    assert bench.main(["project", "--allreduce-json", pj.DEFAULT_ALLREDUCE_JSON,
                       "--kernels-json", "none", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["inputs"] == {"allreduce_json": {
        "path": pj.DEFAULT_ALLREDUCE_JSON, "command": stored["command"],
        "commit": stored["commit"], "device": "NVIDIA H200"}}
    # A projection computes nothing on a device, and its JSON says so.
    assert res["device"] == pj.NO_DEVICE and list(res)[:3] == ["command", "commit", "device"]


def test_device_hbm_table():
    assert pj._device_hbm("NVIDIA H200") == 4800
    assert pj._device_hbm("NVIDIA H100 80GB HBM3") == 3350
    assert pj._device_hbm("NVIDIA H100 PCIe") == 2000
    assert pj._device_hbm("NVIDIA A100-SXM4-80GB") == 2039
    assert pj._device_hbm("NVIDIA A100-SXM4-40GB") == 1555
    assert pj._device_hbm("Tesla V100") is None
    eff = pj.load_efficiency(None, ALLREDUCE)
    assert eff.measured_hbm_gbps == 4800 and "allreduce_json_hbm" not in eff.sources


def test_project_shape_and_monotonicity():
    eff = pj.load_efficiency(KERNELS, ALLREDUCE)
    sizes = [64 * MiB, 256 * MiB, GiB]
    res = pj.project(list(pj.PRESETS.values()), sizes, [4, 8], ["float32", "bfloat16"], eff)
    rows = _rows(res)
    assert len(res["rows"]) == len(pj.PRESETS) * 2 * 2 * 3 * len(pj.ROWS)  # presets, P, dtypes, sizes
    for (preset, P, dtype, size, row), r in rows.items():
        if row.startswith("comp-"):
            # The stored JSON has no added_to_next_matmul_s: not projected.
            assert r["overlapped_s"] is None and r["speedup_vs_psum"] is None
            continue
        assert r["overlapped_s"] > 0 and r["overlapped_s"] <= r["serial_s"] + 1e-15
        if row == "psum":
            assert r["speedup_vs_psum"] == 1.0
        # Bigger messages take longer.
        bigger = rows.get((preset, P, dtype, size * 4, row))
        if bigger:
            assert bigger["overlapped_s"] > r["overlapped_s"]
    for preset in pj.PRESETS:
        for dtype in ("float32", "bfloat16"):
            # P = 8 vs P = 4: the ring's 2(P-1)/P grows from 1.5 to 1.75, and so does Echo's link
            # share (psum: plus 14 instead of 6 latencies).
            p4 = rows[(preset, 4, dtype, GiB, "psum")]["overlapped_s"]
            p8 = rows[(preset, 8, dtype, GiB, "psum")]["overlapped_s"]
            assert 1.75 / 1.5 < p8 / p4 < 1.75 / 1.5 * 1.005
            l4 = rows[(preset, 4, dtype, GiB, "p2p4")]["link_s"]
            l8 = rows[(preset, 8, dtype, GiB, "p2p4")]["link_s"]
            assert l8 / l4 == pytest.approx(1.75 / 1.5)
    for preset in pj.PRESETS:
        f = rows[(preset, 4, "float32", GiB, "psum")]["overlapped_s"]
        b = rows[(preset, 4, "bfloat16", GiB, "psum")]["overlapped_s"]
        assert f == pytest.approx(b)  # same bytes per rank: the size is bytes, not values


def test_measured_json_paths():
    eff = pj.load_efficiency(KERNELS, ALLREDUCE)
    assert eff.measured and eff.kernel_eff
    # The kernels JSON: copy 2990 GB/s on an H200 (4800 GB/s), quantize 4-bit fp32 at 76 %.
    with open(KERNELS) as f:
        kern = json.load(f)
    copy = next(r for r in kern["rows"] if r["op"].startswith("copy"))
    assert eff.copy_eff == pytest.approx(copy["gbps"] / 4800)
    assert eff.kernel("quantize", 4, "float32") == pytest.approx(
        next(r["pct_of_copy"] for r in kern["rows"]
             if r["op"] == "quantize 4-bit" and r["dtype"] == "float32") / 100)
    # The measured p2p4 row at 256 MB on 4 virtual ranks, re-derived by hand.
    with open(ALLREDUCE) as f:
        ar = json.load(f)
    t = next(r["median_s"] for r in ar["rows"]
             if r["row"] == "p2p4" and r["size_bytes"] == 256 * MiB)
    expect = 64 * MiB * 9.59375 * 4 / t / 1e9
    assert pj.measured_hbm_gbps(eff, "p2p4", 256 * MiB, 4800.0) == pytest.approx(expect)
    assert pj.measured_hbm_gbps(eff, "p2p4", GiB, 2400.0) == pytest.approx(expect / 2)
    link = pj.PRESETS["h200-nvlink4"]
    r = pj.project_one(link, "p2p4", 256 * MiB, 4, "float32", eff)
    assert r["hbm_source"] == "allreduce-json"
    # Same machine and P as the measurement: H is the measured time per virtual rank.
    assert r["hbm_s"] == pytest.approx(t / 4)
    assert pj.project_one(link, "p2p4", 256 * MiB, 4, "float32",
                          pj.load_efficiency(KERNELS, "none"))["hbm_source"] == "kernels-json"
    assert pj.load_efficiency("none", "none").kernel_eff == {}


# --------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("argv", [["--help"], ["project", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and "project" in out


@pytest.mark.parametrize("argv", [["project", "--preset", "b200"], ["project", "--ranks", "16"],
                                  ["project", "--link-gbps", "-1"],
                                  ["project", "--dtypes", "int8"]])
def test_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2


def test_cli_writes_json_from_stored_results(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the default JSON paths are relative to the repository root
    out = tmp_path / "sub" / "project.json"
    png = tmp_path / "project.png"
    assert bench.main(["project", "--json", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "PROJECTION" in text and "2.65x" in text and "2.09x" in text and "1.63x" in text
    res = json.loads(out.read_text())
    assert res["benchmark"] == "project" and "not a measurement" in res["note"]
    assert res["sources"]["allreduce_json"].endswith("bench_allreduce_h200x1-virtual4.json")
    assert len(res["rows"]) == len(pj.PRESETS) * 2 * 2 * 3 * len(pj.ROWS)  # presets, P, dtypes, sizes
    assert {r["hbm_source"] for r in res["rows"]
            if r["row"] != "psum" and not r["row"].startswith("comp-")} == {"allreduce-json"}
    assert len(res["not_projected"]) == 4  # comp-fused, comp-separate x fp32, bf16
    assert png.exists() and png.stat().st_size > 0
    assert not [p for p in os.listdir(out.parent) if p.endswith(".tmp")]
    # Overrides reach the model: doubling the link bandwidth halves psum's bandwidth term.
    out2 = tmp_path / "p2.json"
    assert bench.main(["project", "--preset", "a100-nvlink3", "--ranks", "4", "--sizes", "1GB",
                       "--dtypes", "bfloat16", "--nccl-busbw-gbps", "358", "--latency-us", "0",
                       "--allreduce-json", "none", "--kernels-json", "none",
                       "--json", str(out2)]) == 0
    rows = {r["row"]: r for r in json.loads(out2.read_text())["rows"]}
    assert rows["psum"]["overlapped_s"] == pytest.approx(1.5 * GiB / 358e9)
    assert rows["p2p4"]["hbm_source"] == "default"
