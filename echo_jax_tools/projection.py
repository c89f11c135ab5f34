r"""Projection of one all-reduce on a real P-GPU NVLink machine from single-GPU measurements.

    python -m echo_jax_tools.bench project [--preset a100-nvlink3|h100-nvlink4|h200-nvlink4|all]
        [--ranks 4,8] [--sizes 64MB,256MB,1GB] [--dtypes float32,bfloat16] [--link-gbps G]
        [--latency-us A] [--hbm-gbps H] [--nccl-busbw-gbps B] [--p2p-eff E] [--state-bytes 4|2|1]
        [--residual output|local]
        [--kernels-json F|none] [--allreduce-json F|none] [--json OUT] [--png OUT]

This is a model, not a measurement: the project has measured Echo on one GPU only (virtual ranks),
so every number here is a projection from a stated link model and the measured single-GPU stage
times. Pure Python + NumPy: it imports no JAX and needs no GPU.

Notation (per rank; "GB/s" is 1e9 bytes/s, sizes are per rank in the input dtype, MB/GB = 2^20/2^30)
---------------------------------------------------------------------------------------------
    S = message bytes per rank, e = bytes per input element (fp32 4, bf16 2), N = S / e elements
    b = bits (4 or 8), g = group size (128), P = ranks
    w = wire bytes per element = b/8 + 4/g (asym: fp16 scale + fp16 zero-point per group)
                                 b/8 + 2/g (sym: fp16 scale only)       (the Echo paper, Sec. 4.3)
    B = per-direction NVLink bandwidth of one GPU, alpha = per-message latency
    B_nccl = NCCL's effective all-reduce bus bandwidth, eta_p2p = fraction of B that Echo's
             peer-to-peer stores reach
    H_eff = effective HBM bandwidth of a stage (below)

Ideal byte ratio against 16-bit: 2 / w = 16 / (b + 32/g) = 3.76x at b = 4, g = 128 (Sec. 4,
Table 1).

Rows
----
psum (NCCL ring in the input dtype; the Echo paper's 16-bit baseline is the bf16 row):
    T_psum = 2 (P-1)/P * S / B_nccl + 2 (P-1) alpha

Echo custom call, p2p4 / p2p8 (Sec. 4.1-4.2, App. C): push sends (P-1)/P of the message as codes,
gather sends (P-1)/P of the reduced codes; every GPU sends and receives at once over its own links:
    L   = 2 (P-1)/P * N w / (eta_p2p B)                                        (link time)
    HBM bytes per element (push reads the non-owned x and writes codes into the peers; reduce reads
    the own x and the P-1 received codes, writes the gathered codes into the peers and the own y;
    tail reads the P-1 owners' codes and writes y):
        push   (P-1)/P (e + w)
        reduce e/P + 2 (P-1)/P w + e/P
        tail   (P-1)/P (w + e)
        total  2 e + 4 (P-1)/P w
    H   = sum over stages of N bytes_stage / H_eff(stage)                       (local HBM time)
    T_overlapped = max(L, H) + min(L, H) / k + C * 2 alpha     (tiled pipeline; k tiles per chunk,
                   C chunks: one tile's worth of fill per chunk plus the push and gather flags)
    T_serial     = L + H + C * 2 alpha                                           (no overlap)
  k and C follow the kernel's launch plan (ffi/p2p_cuda.cu): tiles of <= 16384 values, >= 64 tiles
  per segment, a chunk = the tiles whose codes fit one 32 MiB receive slot (one launch per chunk).

comp-fused, comp-separate (p2p4 with the compensator: fused in the call, Sec. 5.3; or the apply
step in the call and the update as its own op after it, `EchoConfig.state_update="separate"`):
projected only from a measured added time, never from an assumed one. `bench allreduce
--next-matmul D` times every row followed by the next layer's matrix multiplication of its sum
and records added_to_next_matmul_s, A = (row + matmul) - (matmul alone): what the call adds to
the critical path, the Echo paper's Table 2 method (Sec. 7.1). From that JSON, in the projected
dtype, at the measured size S_m nearest to S (log scale) where both p2p4 and the compensated row
have A:
    D_m = A(compensated row, S_m) - A(p2p4, S_m)      (seconds, P_v virtual ranks on one GPU)
is what compensation costs over plain p2p4: the state's HBM traffic and whatever of the update did
not run beside the matmul. No link carries it, and nothing measured shows it overlapping
anything, so the projection scales it as it scales HBM work (per rank, linear in the values, by
the ratio of the HBM bandwidths; the compensator's work per rank does not depend on P) and adds
it to the critical path in full:
    D = max(D_m, 0) / P_v * (S / S_m) * hbm_measured_device / hbm_target
    T(comp) = T(p2p4) + D                              (overlapped and serial alike)
with T(p2p4) the p2p4 row of this projection. Measured rows: comp-fused <- p2p4-comp-fused
(fp32 state; p2p4-comp-fused-bf16state with --state-bytes 2, p2p4-comp-fused-int8state with
--state-bytes 1, p2p4-comp-fused-int8state-local with --state-bytes 1 --residual local),
comp-separate <-
p2p4-comp-separate (fp32 state). Where the JSON lacks A for p2p4 or the compensated row in the
projected dtype (or has no such row), the row is not projected: its times are null, and the
table and the JSON's not_projected say why.

xla4 (the two-collective baseline, transport "xla": quantize + all-to-all + fp32 sum + quantize +
all-gather), no overlap:
    T_xla4 = 2 (P-1)/P * N w / B_nccl + 2 (P-1) alpha + N [2 e + 3 w + (e + 8 + w)/P] / H_eff
    (quantize all of x: e + w; dequantize P copies + own x + write the fp32 sum: w + (e + 4)/P;
    quantize the sum: (4 + w)/P; dequantize the gathered codes into y: w + e)

HBM efficiency, in order of preference:
  1. `--allreduce-json` (`bench allreduce --virtual`, default results/gpu/
     bench_allreduce_h200x1-virtual4.json): P_v virtual ranks on one GPU, all traffic local, so the
     GPU moves P_v ranks' HBM bytes in the measured time:
        H_eff(row) = bytes_model(row, N_m, P_v, dtype_m) * P_v / T_measured(row, S_m)
                     * hbm_target / hbm_measured_device
     at the measured size nearest to S (log scale); one H_eff for all stages of the row. xla4, p2p4
     and p2p8 use their own rows (median_s, the call alone).
  2. `--kernels-json` (`bench kernels`, default results/gpu/bench_kernels.json): the copy's measured
     fraction of the measured device's datasheet HBM bandwidth (eta_copy) and each kernel's
     fraction of the copy (eta_kernel: push = quantize b-bit in the input dtype, reduce = mean of
     quantize b-bit fp32 and dequantize b-bit, tail = dequantize b-bit; xla4 = their mean):
        H_eff(stage) = hbm_target * eta_copy * eta_kernel(stage)
  3. Neither: eta_copy = 0.8 and eta_kernel = 0.75 (assumptions).
  hbm_measured_device is the datasheet HBM bandwidth of the JSON's "device" (DEVICE_HBM_GBPS);
  for a device not in that table the ratio is taken as 1 and the output's sources say so.
The standalone kernels of `bench kernels` are the fast quantizer; the all-reduce kernel still uses
the generic one, so 1. is the projection of the code as it is and 2. of an all-reduce kernel that
streams at the standalone kernels' efficiency.

Link presets (defaults; every value is overridable by a flag):
  h200-nvlink4: B = 450 GB/s per direction (NVIDIA H200 SXM datasheet: NVLink 900 GB/s, the sum of
      both directions over 18 NVLink4 links); HBM 4800 GB/s (datasheet: 4.8 TB/s HBM3e);
      B_nccl = 370 GB/s (ring: NCCL's maintainers quote ~370 GB/s effective NVLink4 bandwidth after
      ~20 % protocol overhead; NCCL's NVLink SHARP algorithm reaches ~480 GB/s bus bandwidth on 8
      GPUs, pass --nccl-busbw-gbps 480 to model it); eta_p2p = 0.82 (the same protocol overhead);
      alpha = 1 us (assumption: NCCL's small-message all-reduce latency over 2 (P-1) steps is of
      this order).
  h100-nvlink4: the NVLink4 link and NCCL model of h200-nvlink4 (NVIDIA H100 SXM datasheet: NVLink
      900 GB/s over 18 NVLink4 links, B = 450 GB/s per direction), HBM 3350 GB/s (datasheet: 3.35
      TB/s HBM3, the H100 SXM 80GB), B_nccl = 370 GB/s, eta_p2p = 0.82, alpha = 1 us.
  a100-nvlink3: B = 300 GB/s per direction (NVIDIA A100 SXM datasheet: NVLink 600 GB/s over 12
      NVLink3 links); HBM 2039 GB/s (A100 80GB SXM datasheet; the 40GB part has 1555 GB/s);
      B_nccl = 179 GB/s, derived from the Echo paper's own NCCL time (Sec. 7, Table 2: 9.00 ms for
      a 1 GB 16-bit all-reduce at P = 4, read as 2^30 bytes: 2 * 3/4 * 2^30 B / 9.00 ms), so the
      psum row reproduces the baseline the paper's speed-ups are relative to; eta_p2p = 0.82;
      alpha = 1 us.
The paper's anchors (8x A100 NVLink, P = 4, g = 128, 1 GB 16-bit messages; Sec. 7, Table 2):
Echo 4-bit 2.65x, 4-bit with fused compensation 2.09x, 8-bit 1.63x against 16-bit NCCL.

Output: a table (the compensated rows' cells read "not projected" where no added time was
measured) and, with --json, the rows and their sources: "command", "commit" and "device" of this
projection (the device: NO_DEVICE, it computes nothing on one), and under "inputs" each input
JSON's path with its own "command", "commit" and "device" fields as the file has them (null where
it has none).

A measurement with the added times (one GPU, 4 virtual ranks), then the one line that projects it:
    python -m echo_jax_tools.bench allreduce --virtual --ranks 4 --sizes 64MB,256MB \
        --dtype bfloat16 --rows psum,xla4,p2p8,p2p4,p2p4-comp-fused,p2p4-comp-separate \
        --next-matmul 4096 --json AR.json --no-plot
    python -m echo_jax_tools.bench project --dtypes bfloat16 --allreduce-json AR.json --json P.json

Not modelled: NVSwitch contention beyond the per-direction link limit, kernel launch and host
overheads, clock and power limits, NCCL's algorithm choice (ring only), HBM traffic of NCCL itself
(not counted: its link time is taken to dominate), and anything a real multi-GPU run would show
that one GPU cannot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from echo_jax import policies
from echo_jax._cli import format_size, parse_sizes, write_json
from echo_jax.transports.base import segment_layout
from echo_jax_tools import provenance as _provenance
from echo_jax_tools.provenance import source_commit  # noqa: F401 - projection.source_commit

#: Rows of the projection, in the order they are printed.
ROWS = ("psum", "xla4", "p2p4", "p2p8", "comp-fused", "comp-separate")

ROW_LABELS = {
    "psum": "NCCL ring all-reduce in the input dtype",
    "xla4": "two-collective 4-bit (quantize, all-to-all, sum, quantize, all-gather)",
    "p2p4": "Echo custom call 4-bit",
    "p2p8": "Echo custom call 8-bit",
    "comp-fused": "Echo 4-bit with the fused compensator: p2p4 plus the measured added time over "
                  "p2p4",
    "comp-separate": "Echo 4-bit, compensator applied in the call, the update as its own op after "
                     "it (state_update='separate'): p2p4 plus the measured added time over p2p4",
}

#: The compensated rows: the `bench allreduce` row measured for each, by state bytes per value.
MEASURED_COMP_ROWS = {
    ("comp-fused", 4.0): "p2p4-comp-fused",
    ("comp-fused", 2.0): "p2p4-comp-fused-bf16state",
    ("comp-fused", 1.0): "p2p4-comp-fused-int8state",
    ("comp-separate", 4.0): "p2p4-comp-separate",
}
#: The same with the local residual (`EchoConfig.residual="local"`, --residual local).
MEASURED_LOCAL_COMP_ROWS = {
    ("comp-fused", 1.0): "p2p4-comp-fused-int8state-local",
    ("comp-fused", 0.5): "p2p4-comp-fused-int4state-local",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

#: The Echo paper's anchors: 8x A100 NVLink, P = 4, g = 128, 1 GB 16-bit (Sec. 7, Table 2).
PAPER_A100_P4_1GB = {"nccl_ms": 9.00, "p2p4": 2.65, "comp-fused": 2.09, "p2p8": 1.63,
                     "comp-fused_ms": 4.30}

#: Datasheet HBM GB/s of a measured device, by a substring of its name (first match wins):
#: H200 SXM 4.8 TB/s; H100 PCIe 2.0, H100 NVL 3.9, H100 SXM 3.35; A100 40GB 1.555, A100 80GB
#: SXM 2.039 (NVIDIA datasheets).
DEVICE_HBM_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0),
                   ("H100", 3350.0), ("A100-SXM4-40GB", 1555.0), ("A100-PCIE-40GB", 1555.0),
                   ("A100", 2039.0))

DEFAULT_KERNELS_JSON = "results/gpu/bench_kernels.json"
DEFAULT_ALLREDUCE_JSON = "results/gpu/bench_allreduce_h200x1-virtual4.json"

#: Kernel launch plan of ffi/p2p_cuda.cu (tile and slot sizes).
TILE_VALUES = 16384
MIN_TILES_PER_SEGMENT = 64
MAX_TILES = 16384
SLOT_BYTES = 32 << 20

#: Assumed efficiencies when no measured JSON is given.
DEFAULT_COPY_EFF = 0.8
DEFAULT_KERNEL_EFF = 0.75


@dataclasses.dataclass(frozen=True)
class Link:
    """A machine's link and memory model (see the module docstring for the sources).

    Attributes:
      name: preset name.
      link_gbps: per-direction NVLink bandwidth of one GPU, GB/s.
      latency_us: per-message latency, microseconds.
      hbm_gbps: datasheet HBM bandwidth, GB/s.
      nccl_busbw_gbps: NCCL's effective all-reduce bus bandwidth, GB/s.
      p2p_eff: fraction of link_gbps that Echo's peer-to-peer stores reach.
      device: substring of the device name this preset describes (for measured JSONs).
    """

    name: str
    link_gbps: float
    latency_us: float
    hbm_gbps: float
    nccl_busbw_gbps: float
    p2p_eff: float
    device: str


PRESETS = {
    "h200-nvlink4": Link("h200-nvlink4", link_gbps=450.0, latency_us=1.0, hbm_gbps=4800.0,
                         nccl_busbw_gbps=370.0, p2p_eff=0.82, device="H200"),
    "h100-nvlink4": Link("h100-nvlink4", link_gbps=450.0, latency_us=1.0, hbm_gbps=3350.0,
                         nccl_busbw_gbps=370.0, p2p_eff=0.82, device="H100"),
    "a100-nvlink3": Link("a100-nvlink3", link_gbps=300.0, latency_us=1.0, hbm_gbps=2039.0,
                         nccl_busbw_gbps=round(2 * 3 / 4 * 2**30 / 9.00e-3 / 1e9, 1),
                         p2p_eff=0.82, device="A100"),
}


# --------------------------------------------------------------------------------------------
# Formulas


def wire_bytes_per_element(bits: int, group_size: int = 128, policy: str = "asym") -> float:
    """Bytes on the wire per value: b/8 of code plus the fp16 group parameters (Echo paper 4.3).

    Args:
      bits: 4 or 8.
      group_size: g, values per group.
      policy: a policy name (`echo_jax.policies`: scale + zero-point 4/g, scale only 2/g).

    Returns:
      b/8 + 4/g (asym) or b/8 + 2/g (sym); 0.53125 at 4 bits, g = 128, asym.
    """
    return policies.wire_bits_per_element(bits, group_size, policy) / 8


def ideal_byte_ratio(bits: int = 4, group_size: int = 128, policy: str = "asym",
                     ref_bytes: float = 2.0) -> float:
    """The ideal byte reduction against `ref_bytes` per value (Echo paper Sec. 4, Table 1).

    Args:
      bits, group_size, policy: the wire format.
      ref_bytes: bytes per value of the baseline (2 for 16-bit).

    Returns:
      ref_bytes / wire bytes: 16 / (4 + 32/128) = 3.76 at 4 bits, g = 128, against 16-bit.
    """
    return ref_bytes / wire_bytes_per_element(bits, group_size, policy)


def ring_allreduce_time(size_bytes: float, ranks: int, busbw_gbps: float,
                        latency_us: float) -> float:
    """Seconds of a ring all-reduce (NCCL): 2 (P-1)/P * S / B_nccl + 2 (P-1) alpha.

    Args:
      size_bytes: S, bytes per rank.
      ranks: P.
      busbw_gbps: effective bus bandwidth, GB/s.
      latency_us: per-step latency, microseconds.

    Returns:
      Seconds (0 for P = 1).
    """
    P = ranks
    return 2 * (P - 1) / P * size_bytes / (busbw_gbps * 1e9) + 2 * (P - 1) * latency_us * 1e-6


def echo_link_time(num_elements: float, ranks: int, wire: float, link_gbps: float,
                   p2p_eff: float = 1.0) -> float:
    """Seconds on the link of Echo's push + gather (Echo paper Sec. 4.1): 2 (P-1)/P N w / (eta B).

    Args:
      num_elements: N, values per rank.
      ranks: P.
      wire: w, wire bytes per value.
      link_gbps: per-direction bandwidth B, GB/s.
      p2p_eff: eta_p2p, fraction of B reached.

    Returns:
      Seconds: every GPU sends (P-1)/P of its message in the push and as much in the gather, all
      links busy at once.
    """
    P = ranks
    return 2 * (P - 1) / P * num_elements * wire / (link_gbps * 1e9 * p2p_eff)


def p2p_stage_bytes(elem_bytes: float, wire: float, ranks: int) -> dict:
    """HBM bytes per value of each stage of the Echo kernel on one GPU (Echo paper Sec. 4.2).

    Args:
      elem_bytes: e, bytes per input / output value.
      wire: w, wire bytes per value.
      ranks: P.

    Returns:
      {"push": (P-1)/P (e + w), "reduce": 2 e/P + 2 (P-1)/P w, "tail": (P-1)/P (w + e)};
      the sum is 2 e + 4 (P-1)/P w. Writes into a peer count on the peer (the same by symmetry).
    """
    P, e, w = ranks, elem_bytes, wire
    f = (P - 1) / P
    return {"push": f * (e + w), "reduce": 2 * e / P + 2 * f * w, "tail": f * (w + e)}


def xla_bytes(elem_bytes: float, wire: float, ranks: int) -> float:
    """HBM bytes per value of the two-collective baseline's XLA passes (transport "xla").

    Args:
      elem_bytes: e; wire: w; ranks: P.

    Returns:
      2 e + 3 w + (e + 8 + w) / P: quantize all of x (e + w), dequantize the P received copies and
      add the own x into an fp32 sum (w + (e + 4)/P), quantize the sum ((4 + w)/P), dequantize the
      gathered codes into y (w + e).
    """
    e, w, P = elem_bytes, wire, ranks
    return 2 * e + 3 * w + (e + 8 + w) / P


def compensator_extra_bytes(elem_bytes: float, state_bytes: float = 4.0) -> float:
    """Extra HBM bytes per value of the fused compensator (Echo paper Sec. 5.3).

    Args:
      elem_bytes: e, bytes per input value.
      state_bytes: s, bytes per value of each of m1 and m2 (4 for fp32, 2 for bf16, 1 for
        int8 codes, whose scales add 4 / 128 that this count leaves out).

    Returns:
      6 s + e: reads m1, m2 at entry (2 s); re-reads x, m1, m2 (e + 2 s) and writes m1, m2 (2 s)
      where y is produced. 28 for fp32 x and state, 14 for bf16 x and state. The projection takes
      the compensated rows' cost from measured added times, not from this count; it is the count
      that explains why that cost is large against p2p4's 2 e + 4 (P-1)/P w.
    """
    return 6 * state_bytes + elem_bytes


def launch_plan(num_elements: int, ranks: int, bits: int, group_size: int = 128,
                policy: str = "asym", slot_bytes: int = SLOT_BYTES) -> tuple:
    """Tiles per chunk and chunks of the Echo kernel's launch plan (`make_plan` in ffi/p2p_cuda.cu).

    Args:
      num_elements: N, values per rank.
      ranks: P; bits, group_size, policy: the wire format; slot_bytes: receive slot size.

    Returns:
      (tiles per chunk k, chunks C).
    """
    g = group_size
    seg_groups, _ = segment_layout(num_elements, ranks, g)
    tile_groups = min(max(math.ceil(seg_groups / MIN_TILES_PER_SEGMENT), 1),
                      max(1, TILE_VALUES // g))
    tiles = math.ceil(seg_groups / tile_groups)
    per_group = policies.wire_bytes_per_group(g, bits, policy)
    cap_tiles = min((slot_bytes - 64) // per_group // tile_groups, MAX_TILES)
    chunk_tiles = max(1, min(cap_tiles, tiles))
    return chunk_tiles, math.ceil(tiles / chunk_tiles)


def pipelined_time(link_s: float, hbm_s: float, tiles_per_chunk: int, chunks: int,
                   latency_us: float) -> dict:
    """Overlapped and serial time of the tiled pipeline (Echo paper Sec. 4.2, App. C).

    Args:
      link_s: L, seconds on the link; hbm_s: H, seconds of local HBM work.
      tiles_per_chunk: k; chunks: C (one launch each); latency_us: alpha.

    Returns:
      {"overlapped": max(L, H) + min(L, H)/k + 2 C alpha, "serial": L + H + 2 C alpha}
      (overlapped <= serial since k >= 1).
    """
    lat = 2 * chunks * latency_us * 1e-6
    return {"overlapped": max(link_s, hbm_s) + min(link_s, hbm_s) / tiles_per_chunk + lat,
            "serial": link_s + hbm_s + lat}


# --------------------------------------------------------------------------------------------
# HBM efficiency from measured JSON files


def _load_json(path):
    if not path or str(path).lower() == "none" or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _device_hbm(device: str | None) -> float | None:
    """Datasheet HBM GB/s of a measured device name ("NVIDIA H200" -> 4800), or None."""
    for name, gbps in DEVICE_HBM_GBPS:
        if device and name.lower() in device.lower():
            return gbps
    return None


#: The "device" of a projection's results JSON: it computes nothing on a device.
NO_DEVICE = "none (a projection from the measured inputs named in `inputs`)"


def provenance(argv) -> dict:
    """{"command", "commit", "device"} of a `python -m echo_jax_tools.bench project` run, for its
    results JSON (`echo_jax_tools.provenance`; the device is NO_DEVICE).

    Args:
      argv: the command's arguments without the program name (None: unknown).
    """
    return _provenance.record(_provenance.command("echo_jax_tools.bench", argv), NO_DEVICE)


def input_record(path, data: dict | None) -> dict | None:
    """What a results JSON records of one input file: its path and its own "command", "commit"
    and "device" fields as the file has them (None where it has none); None without a file."""
    if data is None:
        return None
    return {"path": str(path), **{k: data.get(k) for k in ("command", "commit", "device")}}


@dataclasses.dataclass
class Efficiency:
    """Where H_eff comes from (see the module docstring).

    Attributes:
      copy_eff: eta_copy, the copy's fraction of the datasheet HBM bandwidth.
      kernel_eff: {(op, bits, dtype): fraction of the copy} from the kernels JSON ("quantize" in
        fp32 / bf16, "dequantize" in fp32), empty for the default.
      measured: {(row, size_bytes): (seconds, ranks, dtype)} from the allreduce --virtual JSON.
      added: {(row, size_bytes, dtype): (added_to_next_matmul_s, ranks)} of the rows that have it
        (`bench allreduce --next-matmul`).
      floor: {(row, size_bytes, dtype): floor_s}, each measured row's byte floor (`bench
        allreduce`'s floor_s: its bytes at the run's streaming bandwidth).
      measured_hbm_gbps: datasheet HBM of the device the allreduce JSON was measured on.
      sources: the files used, for the output.
      inputs: per input file ("kernels_json", "allreduce_json") its `input_record`.
    """

    copy_eff: float = DEFAULT_COPY_EFF
    kernel_eff: dict = dataclasses.field(default_factory=dict)
    measured: dict = dataclasses.field(default_factory=dict)
    added: dict = dataclasses.field(default_factory=dict)
    floor: dict = dataclasses.field(default_factory=dict)
    measured_hbm_gbps: float | None = None
    sources: dict = dataclasses.field(default_factory=dict)
    inputs: dict = dataclasses.field(default_factory=dict)

    def kernel(self, op: str, bits: int, dtype: str) -> float:
        """eta_kernel of a stage op ("quantize" / "dequantize"); the default when not measured."""
        for key in ((op, bits, dtype), (op, bits, "float32")):
            if key in self.kernel_eff:
                return self.kernel_eff[key]
        return DEFAULT_KERNEL_EFF


def load_efficiency(kernels_json: str | None = DEFAULT_KERNELS_JSON,
                    allreduce_json: str | None = DEFAULT_ALLREDUCE_JSON) -> Efficiency:
    """The HBM efficiencies from `bench kernels` and `bench allreduce --virtual` JSON files.

    Args:
      kernels_json: path of a `bench kernels` JSON, or None / "none" / a missing file.
      allreduce_json: path of a `bench allreduce` JSON (virtual ranks), or None / "none" / missing.

    Returns:
      An Efficiency: eta_copy = copy GB/s / datasheet HBM of its device and eta_kernel = % of copy
      / 100 per op at the largest measured size; the measured per-row times of the virtual run and
      the added times of its rows that have added_to_next_matmul_s; the inputs' provenance.
    """
    eff = Efficiency()
    kern = _load_json(kernels_json)
    if kern:
        rows = kern.get("rows", [])
        size = max((r["size_bytes"] for r in rows), default=None)
        hbm = _device_hbm(kern.get("device"))
        for r in rows:
            if r["size_bytes"] != size:
                continue
            if r["op"].startswith("copy") and hbm:
                eff.copy_eff = r["gbps"] / hbm
            parts = r["op"].split()
            if len(parts) == 2 and parts[0] in ("quantize", "dequantize") and \
                    parts[1].endswith("-bit"):
                eff.kernel_eff[(parts[0], int(parts[1][:-4]), r["dtype"])] = \
                    r["pct_of_copy"] / 100
        eff.sources["kernels_json"] = str(kernels_json)
        eff.inputs["kernels_json"] = input_record(kernels_json, kern)
    ar = _load_json(allreduce_json)
    if ar and ar.get("rows"):
        eff.measured_hbm_gbps = _device_hbm(ar.get("device"))
        for r in ar["rows"]:
            dtype = r.get("dtype", ar.get("dtype"))
            eff.measured[(r["row"], r["size_bytes"])] = (r["median_s"], r["ranks"], dtype)
            if r.get("added_to_next_matmul_s") is not None:
                eff.added[(r["row"], r["size_bytes"], dtype)] = (r["added_to_next_matmul_s"],
                                                                 r["ranks"])
            if r.get("floor_s") is not None:
                eff.floor[(r["row"], r["size_bytes"], dtype)] = r["floor_s"]
        eff.sources["allreduce_json"] = str(allreduce_json)
        if eff.measured_hbm_gbps is None:
            eff.sources["allreduce_json_hbm"] = (
                f"device {ar.get('device')!r} not in DEVICE_HBM_GBPS: measured times are not "
                "scaled by an HBM ratio")
        eff.inputs["allreduce_json"] = input_record(allreduce_json, ar)
    return eff


def _row_hbm_bytes(row: str, elem_bytes: float, ranks: int, bits_group_policy: tuple) -> float:
    bits, g, policy = bits_group_policy
    w = wire_bytes_per_element(bits, g, policy)
    if row == "xla4":
        return xla_bytes(elem_bytes, w, ranks)
    return sum(p2p_stage_bytes(elem_bytes, w, ranks).values())


def measured_hbm_gbps(eff: Efficiency, row: str, size_bytes: int, target_hbm_gbps: float,
                      group_size: int = 128, policy: str = "asym") -> float | None:
    """H_eff of a row from the virtual-rank measurement, scaled to the target's HBM bandwidth.

    Args:
      eff: the loaded Efficiency; row: "xla4", "p2p4" or "p2p8".
      size_bytes: the projected size (the nearest measured size in log scale is used).
      target_hbm_gbps: datasheet HBM of the projected machine.
      group_size, policy: the wire format of the run.

    Returns:
      GB/s: bytes_model(measured) * P_v / T_measured * target / measured device HBM; None when the
      row was not measured.
    """
    sizes = [s for (r, s) in eff.measured if r == row]
    if not sizes:
        return None
    s_m = min(sizes, key=lambda s: abs(math.log(s / size_bytes)))
    t, P_v, dtype = eff.measured[(row, s_m)]
    e = DTYPE_BYTES.get(dtype, 4)
    bits = 8 if row.endswith("8") else 4
    moved = s_m / e * _row_hbm_bytes(row, e, P_v, (bits, group_size, policy)) * P_v
    scale = target_hbm_gbps / (eff.measured_hbm_gbps or target_hbm_gbps)
    return moved / t / 1e9 * scale


def measured_comp_extra(eff: Efficiency, row: str, size_bytes: int, dtype: str,
                        target_hbm_gbps: float, state_bytes: float = 4.0,
                        residual: str = "output") -> dict:
    """What a compensated row adds over p2p4 on the target, from measured added times.

    D_m = A(measured row) - A(p2p4) at the measured size S_m nearest to S (log scale) among those
    where both have added_to_next_matmul_s in `dtype`; D = max(D_m, 0) / P_v * S / S_m *
    hbm_measured / hbm_target (see the module docstring).

    Args:
      eff: the loaded Efficiency; row: "comp-fused" or "comp-separate"; size_bytes: S per rank;
      dtype: the projected dtype (the measurement must be in it); target_hbm_gbps: datasheet HBM
      of the projected machine; state_bytes: 4 (fp32 state), 2 (bf16) or 1 (int8);
      residual: "output" or "local" (`EchoConfig.residual`; MEASURED_LOCAL_COMP_ROWS).

    Returns:
      dict(measured_row, measured_size_bytes, measured_ranks, added_s, p2p4_added_s,
      extra_measured_s (D_m), extra_s (D), extra_floor_measured_s: the byte floor of D_m, the
      measured row's floor_s minus p2p4's, None where the JSON has no floor); or
      dict(not_projected=reason) when the added time was not measured.
    """
    table = MEASURED_LOCAL_COMP_ROWS if residual == "local" else MEASURED_COMP_ROWS
    measured_row = table.get((row, float(state_bytes)))
    if measured_row is None:
        return {"not_projected": f"no measured row for {row} with a {state_bytes:g}-byte state "
                                 f"and the {residual} residual"}
    sizes = [s for (r, s, d) in eff.added
             if r == measured_row and d == dtype and ("p2p4", s, dtype) in eff.added]
    if not sizes:
        where = eff.sources.get("allreduce_json", "no allreduce JSON")
        return {"not_projected": f"no measured added time (added_to_next_matmul_s of p2p4 and "
                                 f"{measured_row} in {dtype}; {where})"}
    s_m = min(sizes, key=lambda s: abs(math.log(s / size_bytes)))
    added, P_v = eff.added[(measured_row, s_m, dtype)]
    base = eff.added[("p2p4", s_m, dtype)][0]
    d_m = added - base
    scale = _hbm_ratio(eff, target_hbm_gbps)
    floors = [eff.floor.get((r, s_m, dtype)) for r in (measured_row, "p2p4")]
    return {"measured_row": measured_row, "measured_size_bytes": s_m, "measured_ranks": P_v,
            "added_s": added, "p2p4_added_s": base, "extra_measured_s": d_m,
            "extra_s": max(d_m, 0.0) / P_v * size_bytes / s_m * scale,
            "extra_floor_measured_s": None if None in floors else floors[0] - floors[1]}


def measured_extra_for(extra_s: float, r: dict, target_hbm_gbps: float, eff: Efficiency) -> float:
    """The inverse of `measured_comp_extra`'s scaling: the D_m, measured as the row `r` was
    (its measured_size_bytes and measured_ranks, on the allreduce JSON's device), that projects
    to the extra `extra_s` on a machine with `target_hbm_gbps`.

    Args:
      extra_s: D on the target (negative: no D_m reaches it); r: a projected compensated row
        (`project_one`); target_hbm_gbps: datasheet HBM of the projected machine; eff: as loaded.

    Returns:
      D_m = D * P_v * S_m / S * hbm_target / hbm_measured, in seconds.
    """
    return (extra_s * r["measured_ranks"] * r["measured_size_bytes"] / r["size_bytes"] /
            _hbm_ratio(eff, target_hbm_gbps))


def _hbm_ratio(eff: Efficiency, target_hbm_gbps: float) -> float:
    """HBM(measured device) / HBM(target): how a measured extra scales to the target (1 where
    the measured device is unknown)."""
    return (eff.measured_hbm_gbps or target_hbm_gbps) / target_hbm_gbps


# --------------------------------------------------------------------------------------------
# The projection


def project_one(link: Link, row: str, size_bytes: int, ranks: int, dtype: str,
                eff: Efficiency, *, group_size: int = 128, policy: str = "asym",
                state_bytes: float = 4.0, residual: str = "output") -> dict:
    """Projected time of one all-reduce row on one machine.

    Args:
      link: the machine (Link); row: one of ROWS; size_bytes: S per rank in `dtype`;
      ranks: P; dtype: "float32" or "bfloat16"; eff: HBM efficiencies (load_efficiency);
      group_size, policy: the wire format; state_bytes: compensator state bytes per value;
      residual: the compensator's residual ("output" or "local", `EchoConfig.residual`).

    Returns:
      dict(row, size_bytes, ranks, dtype, link_s, hbm_s, overlapped_s, serial_s, hbm_source):
      overlapped == serial for psum and xla4, which do not overlap; psum's hbm_s is 0 (NCCL's
      own memory traffic is not counted). A compensated row is p2p4's plus extra_s and the
      fields of `measured_comp_extra`; without a measured added time its times are None and
      not_projected says why.
    """
    e = DTYPE_BYTES[dtype]
    N = size_bytes / e
    P = ranks
    lat = link.latency_us
    out = dict(row=row, size_bytes=size_bytes, ranks=P, dtype=dtype)
    if row == "psum":
        t = ring_allreduce_time(size_bytes, P, link.nccl_busbw_gbps, lat)
        return {**out, "link_s": t, "hbm_s": 0.0, "overlapped_s": t, "serial_s": t,
                "hbm_source": "none"}
    if row.startswith("comp-"):
        # p2p4 plus the measured added time over p2p4, on the critical path in full.
        extra = measured_comp_extra(eff, row, size_bytes, dtype, link.hbm_gbps, state_bytes,
                                    residual)
        if "not_projected" in extra:
            return {**out, "link_s": None, "hbm_s": None, "overlapped_s": None, "serial_s": None,
                    "hbm_source": None, **extra}
        base = project_one(link, "p2p4", size_bytes, P, dtype, eff, group_size=group_size,
                           policy=policy)
        return {**base, **out, "overlapped_s": base["overlapped_s"] + extra["extra_s"],
                "serial_s": base["serial_s"] + extra["extra_s"],
                "p2p4_overlapped_s": base["overlapped_s"], **extra}
    copy_gbps = link.hbm_gbps * eff.copy_eff
    bits = 8 if row == "p2p8" else 4
    w = wire_bytes_per_element(bits, group_size, policy)
    measured = measured_hbm_gbps(eff, row, size_bytes, link.hbm_gbps, group_size, policy)
    if row == "xla4":
        L = (ring_allreduce_time(N * w, P, link.nccl_busbw_gbps, lat))  # all-to-all + all-gather
        if measured:
            H, src = N * xla_bytes(e, w, P) / (measured * 1e9), "allreduce-json"
        else:
            k = np.mean([eff.kernel("quantize", bits, dtype),
                         eff.kernel("dequantize", bits, dtype)])
            H = N * xla_bytes(e, w, P) / (copy_gbps * k * 1e9)
            src = "kernels-json" if eff.kernel_eff else "default"
        return {**out, "link_s": L, "hbm_s": H, "overlapped_s": L + H, "serial_s": L + H,
                "hbm_source": src}
    L = echo_link_time(N, P, w, link.link_gbps, link.p2p_eff)
    stages = p2p_stage_bytes(e, w, P)
    if measured:
        H, src = N * sum(stages.values()) / (measured * 1e9), "allreduce-json"
    else:
        tail_eff = eff.kernel("dequantize", bits, dtype)
        stage_eff = {"push": eff.kernel("quantize", bits, dtype),
                     "reduce": (eff.kernel("quantize", bits, "float32") + tail_eff) / 2,
                     "tail": tail_eff}
        H = sum(N * b / (copy_gbps * stage_eff[s] * 1e9) for s, b in stages.items())
        src = "kernels-json" if eff.kernel_eff else "default"
    k, C = launch_plan(int(N), P, bits, group_size, policy)
    t = pipelined_time(L, H, k, C, lat)
    return {**out, "link_s": L, "hbm_s": H, "overlapped_s": t["overlapped"],
            "serial_s": t["serial"], "hbm_source": src, "tiles_per_chunk": k, "chunks": C}


def project(links, sizes, ranks, dtypes, eff: Efficiency, *, group_size: int = 128,
            policy: str = "asym", state_bytes: float = 4.0, residual: str = "output",
            target_speedup: float = 2.0) -> dict:
    """The projection over machines x ranks x dtypes x sizes x ROWS.

    Args:
      links: Link objects; sizes: bytes per rank; ranks: P values; dtypes: dtype names;
      eff: HBM efficiencies; group_size, policy, state_bytes, residual: as in project_one;
      target_speedup: a compensated row's goal against psum, for extra_measured_at_target_s.

    Returns:
      dict(benchmark="project", presets, rows, anchors, sources, inputs, not_projected, ...):
      each row of project_one plus speedup_vs_psum (overlapped) and serial_speedup_vs_psum,
      against psum of the same machine, P, dtype and size (None for a row not projected);
      a projected compensated row also extra_measured_at_target_s, the largest added time over
      p2p4, measured as its own was, at which it reaches target_speedup (`measured_extra_for`;
      negative: p2p4 alone does not); not_projected lists once per row and dtype why a row was
      not projected.
    """
    rows, skipped = [], {}
    for link in links:
        for P in ranks:
            for dtype in dtypes:
                for size in sizes:
                    psum = None
                    for row in ROWS:
                        r = project_one(link, row, size, P, dtype, eff, group_size=group_size,
                                        policy=policy, state_bytes=state_bytes,
                                        residual=residual)
                        r["preset"] = link.name
                        psum = psum or r["overlapped_s"]
                        if r["overlapped_s"] is None:
                            r["speedup_vs_psum"] = r["serial_speedup_vs_psum"] = None
                            skipped.setdefault((row, dtype), r["not_projected"])
                        else:
                            r["speedup_vs_psum"] = psum / r["overlapped_s"]
                            r["serial_speedup_vs_psum"] = psum / r["serial_s"]
                            if row.startswith("comp-"):
                                r["extra_measured_at_target_s"] = measured_extra_for(
                                    psum / target_speedup - r["p2p4_overlapped_s"], r,
                                    link.hbm_gbps, eff)
                        rows.append(r)
    return {
        "benchmark": "project",
        "note": "a projection from a link model and single-GPU measurements, not a measurement",
        "presets": [dataclasses.asdict(link) for link in links],
        "group_size": group_size, "policy": policy, "state_bytes": state_bytes,
        "residual": residual, "target_speedup": target_speedup,
        "copy_eff": eff.copy_eff,
        "kernel_eff": {f"{op} {b}-bit {d}": v for (op, b, d), v in eff.kernel_eff.items()},
        "sources": eff.sources,
        "inputs": eff.inputs,
        "not_projected": [{"row": row, "dtype": dtype, "reason": why}
                          for (row, dtype), why in skipped.items()],
        "ideal_byte_ratio_4bit_vs_16bit": ideal_byte_ratio(4, group_size, policy),
        "paper_a100_p4_1gb": PAPER_A100_P4_1GB,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------
# Output


def _cell(r: dict) -> str:
    if r["overlapped_s"] is None:
        return "not projected"
    return f"{r['overlapped_s'] * 1e3:.3f} ({r['speedup_vs_psum']:.2f}x)"


def _target_lines(result: dict) -> list:
    """Per compensated row, P and dtype, at 1 GiB a rank (else the largest size): what it adds
    over p2p4 where measured, that time's byte floor, and the most it may add for the target on
    each machine."""
    lines, groups = [], {}
    for r in result["rows"]:
        if r["row"].startswith("comp-") and r.get("extra_measured_at_target_s") is not None:
            groups.setdefault((r["row"], r["ranks"], r["dtype"]), []).append(r)
    for (row, P, dtype), rr in groups.items():
        size = 1 << 30 if any(r["size_bytes"] == 1 << 30 for r in rr) else \
            max(r["size_bytes"] for r in rr)
        rr = [r for r in rr if r["size_bytes"] == size]
        r0 = rr[0]
        floor = r0.get("extra_floor_measured_s")
        floor = "" if floor is None else f" (its byte floor {floor * 1e3:.3f} ms)"
        need = ", ".join(f"{r['preset']} {r['extra_measured_at_target_s'] * 1e3:.3f} ms"
                         for r in rr)
        lines.append(f"{row}, P={P}, {format_size(size)} {dtype}: {r0['measured_row']} adds "
                     f"{r0['extra_measured_s'] * 1e3:.3f} ms over p2p4 where measured{floor}; "
                     f"{result['target_speedup']:.2f}x psum needs at most: {need}")
    return lines


def format_table(result: dict) -> str:
    """Text table: per machine, P, dtype and size, projected ms (overlapped) and speedup vs psum.

    Args:
      result: the dict of `project`.

    Returns:
      The table, with the serial (no-overlap) speedup of p2p4, the paper's A100 anchors, the rows
      not projected and why, and the inputs.
    """
    lines = []
    by_key = {}
    for r in result["rows"]:
        by_key.setdefault((r["preset"], r["ranks"], r["dtype"], r["size_bytes"]), {})[r["row"]] = r
    head = ("| machine | P | dtype | size | psum ms | " +
            " | ".join(f"{row} ms (x)" for row in ROWS[1:]) + " | p2p4 serial (x) |")
    lines += ["PROJECTION (link model + single-GPU measurements; not a measurement)", head,
              "|" + "---|" * (head.count("|") - 1)]
    for (preset, P, dtype, size), rr in by_key.items():
        cells = [_cell(rr[row]) for row in ROWS[1:]]
        ser = rr["p2p4"]
        lines.append(f"| {preset} | {P} | {dtype} | {format_size(size)} | "
                     f"{rr['psum']['overlapped_s'] * 1e3:.3f} | " + " | ".join(cells) +
                     f" | {ser['serial_s'] * 1e3:.3f} ({ser['serial_speedup_vs_psum']:.2f}x) |")
    a = result["paper_a100_p4_1gb"]
    mine = by_key.get(("a100-nvlink3", 4, "bfloat16", 1 << 30))
    lines.append("")
    lines.append(f"Echo paper, 8x A100 NVLink, P=4, 1 GB 16-bit (measured): NCCL "
                 f"{a['nccl_ms']:.2f} ms;"
                 f" p2p4 {a['p2p4']:.2f}x, comp-fused {a['comp-fused']:.2f}x, "
                 f"p2p8 {a['p2p8']:.2f}x")
    if mine:
        def x(row):
            v = mine[row]["speedup_vs_psum"]
            return "not projected" if v is None else f"{v:.2f}x"
        lines.append(f"this projection, a100-nvlink3, P=4, 1GB bfloat16:        NCCL "
                     f"{mine['psum']['overlapped_s'] * 1e3:.2f} ms; p2p4 {x('p2p4')}, "
                     f"comp-fused {x('comp-fused')}, p2p8 {x('p2p8')}; comp-separate "
                     f"{x('comp-separate')}")
    lines.append("compensated rows: p2p4 plus the measured added time over p2p4 "
                 "(bench allreduce --next-matmul), on the critical path in full")
    lines += _target_lines(result)
    for item in result.get("not_projected", []):
        lines.append(f"not projected: {item['row']} ({item['dtype']}): {item['reason']}")
    src = sorted({r["hbm_source"] for r in result["rows"]
                  if r["row"] != "psum" and r["hbm_source"]})
    lines.append(f"HBM time from: {', '.join(src)} ({result['sources'] or 'no JSON'}); "
                 f"ideal 4-bit byte ratio vs 16-bit: "
                 f"{result['ideal_byte_ratio_4bit_vs_16bit']:.2f}x")
    for name, rec in result.get("inputs", {}).items():
        if rec:
            lines.append(f"input {name}: {rec['path']} (device {rec['device']}, commit "
                         f"{rec['commit']}, command {rec['command']})")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Speedup vs psum against size, one panel per machine and P (matplotlib, Agg).

    Args:
      result: the dict of `project`; path: the PNG to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["preset"], r["ranks"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (preset, P) in zip(axes[0], panels):
        for row in ROWS[1:]:
            for dtype, style in (("float32", "-"), ("bfloat16", "--")):
                pts = sorted((r["size_bytes"], r["speedup_vs_psum"]) for r in result["rows"]
                             if (r["preset"], r["ranks"], r["row"], r["dtype"]) ==
                             (preset, P, row, dtype) and r["speedup_vs_psum"] is not None)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot([x / 2**20 for x in xs], ys, style, marker="o", label=f"{row} {dtype}")
        if preset == "a100-nvlink3" and P == 4:
            for key, marker in (("p2p4", "*"), ("comp-fused", "P"), ("p2p8", "X")):
                ax.plot([1024], [result["paper_a100_p4_1gb"][key]], marker, color="k",
                        label=f"paper {key} (A100)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MiB per rank")
        ax.set_ylabel("projected speedup vs psum")
        ax.set_title(f"{preset}, P={P} (projection)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line (registered as `python -m echo_jax_tools.bench project`)


def _list_arg(choices):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise ValueError(f"bad value {','.join(bad) or text!r}: use {', '.join(choices)}")
        return items
    return parse


def add_arguments(p) -> None:
    """The flags of `bench project` on an argparse parser."""
    import argparse

    def wrap(fn):
        def parse(text):
            try:
                return fn(text)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return parse

    def positive(text):
        v = float(text)
        if not v > 0:
            raise ValueError(f"must be positive, got {text}")
        return v

    def ranks(text):
        vals = [int(t) for t in text.split(",") if t.strip()]
        if not vals or any(v < 2 or v > 8 for v in vals):
            raise ValueError(f"ranks must be 2..8 (one NVLink domain), got {text!r}")
        return vals

    p.add_argument("--preset", type=wrap(_list_arg(tuple(PRESETS) + ("all",))), default=["all"],
                   help="link presets: " + ", ".join(PRESETS) + ", or all (default: all)")
    p.add_argument("--ranks", type=wrap(ranks), default=[4, 8], metavar="P",
                   help="ranks, comma list (default: 4,8)")
    p.add_argument("--sizes", type=wrap(parse_sizes), default=parse_sizes("large"),
                   help="message sizes per rank in the input dtype (default: 64MB,256MB,1GB)")
    p.add_argument("--dtypes", type=wrap(_list_arg(tuple(DTYPE_BYTES))),
                   default=["float32", "bfloat16"], help="input dtypes (default: float32,bfloat16)")
    p.add_argument("--link-gbps", type=wrap(positive), default=None,
                   help="per-direction NVLink GB/s per GPU (default: the preset's)")
    p.add_argument("--latency-us", type=float, default=None,
                   help="per-message latency in microseconds (default: the preset's)")
    p.add_argument("--hbm-gbps", type=wrap(positive), default=None,
                   help="datasheet HBM GB/s (default: the preset's)")
    p.add_argument("--nccl-busbw-gbps", type=wrap(positive), default=None,
                   help="NCCL's effective all-reduce bus bandwidth in GB/s (default: the preset's)")
    p.add_argument("--p2p-eff", type=wrap(positive), default=None,
                   help="fraction of the link bandwidth Echo's peer stores reach (default: the "
                        "preset's)")
    p.add_argument("--state-bytes", type=float, choices=(4.0, 2.0, 1.0, 0.5), default=4.0,
                   help="compensator state bytes per value: 4 (fp32, default), 2 (bf16), 1 "
                        "(int8 codes, plus a 4-byte scale a 128 values) or 0.5 (int4 codes, "
                        "with --residual local); picks the measured compensated rows "
                        "(MEASURED_COMP_ROWS)")
    p.add_argument("--residual", choices=("output", "local"), default="output",
                   help="the compensator's residual (EchoConfig.residual): output (default) or "
                        "local, whose measured rows are p2p4-comp-fused-int8state-local "
                        "(with --state-bytes 1) and p2p4-comp-fused-int4state-local "
                        "(--state-bytes 0.5)")
    p.add_argument("--target-speedup", type=wrap(positive), default=2.0,
                   help="a compensated row's goal against psum: the output says the most the "
                        "row may add over p2p4, measured as it was, to reach it on each machine "
                        "(default: %(default)s)")
    p.add_argument("--group-size", type=int, default=128, help="g (default: %(default)s)")
    p.add_argument("--policy", choices=policies.NAMES, default="asym",
                   help="quantizer policy, sets the per-group parameter bytes (default: asym)")
    p.add_argument("--kernels-json", default=DEFAULT_KERNELS_JSON,
                   help="`bench kernels` JSON for the kernel efficiency, or none "
                        "(default: %(default)s when present)")
    p.add_argument("--allreduce-json", default=DEFAULT_ALLREDUCE_JSON,
                   help="`bench allreduce --virtual` JSON for the measured single-GPU time, or "
                        "none (default: %(default)s when present); the compensated rows are "
                        "projected only from its added_to_next_matmul_s (--next-matmul)")
    p.add_argument("--json", metavar="OUT", default=None, help="write the projection to this file")
    p.add_argument("--png", metavar="OUT", default=None, help="plot the speedups to this file")


def links_from_args(args) -> list:
    """The Link objects of the parsed flags (the presets with the flags' overrides)."""
    names = list(PRESETS) if "all" in args.preset else list(dict.fromkeys(args.preset))
    links = []
    for name in names:
        over = {k: v for k, v in (("link_gbps", args.link_gbps),
                                  ("latency_us", args.latency_us),
                                  ("hbm_gbps", args.hbm_gbps),
                                  ("nccl_busbw_gbps", args.nccl_busbw_gbps),
                                  ("p2p_eff", args.p2p_eff)) if v is not None}
        links.append(dataclasses.replace(PRESETS[name], **over))
    return links


def run(args) -> dict:
    """`bench project`: compute, print, and write the JSON / PNG the flags ask for.

    Args:
      args: parsed flags (add_arguments).

    Returns:
      The result dict of `project`, led by the command, commit and device of this run
      (`provenance(args.argv)`; args.argv: the arguments after the program name, when known).
    """
    eff = load_efficiency(args.kernels_json, args.allreduce_json)
    result = {**provenance(getattr(args, "argv", None)),
              **project(links_from_args(args), args.sizes, args.ranks, args.dtypes, eff,
                        group_size=args.group_size, policy=args.policy,
                        state_bytes=args.state_bytes, residual=args.residual,
                        target_speedup=args.target_speedup)}
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.png:
        plot(result, args.png)
        print(f"wrote {args.png}")
    return result
