"""Jit-compiled benchmarks of the Echo all-reduce, its kernels and a tensor-parallel model.

    python -m echo_jax_tools.bench allreduce [--sizes small,large] [--ranks P] [--virtual]
                                             [--rows ...] [--iters 80] [--warmup 30] [--gate]
                                             [--json OUT] [--png OUT]
    python -m echo_jax_tools.bench gate      [--sizes small] [--gate-row ROW]   (the size gate)
    python -m echo_jax_tools.bench kernels   [--sizes 64MB,256MB] [--json OUT]        (one GPU)
    python -m echo_jax_tools.bench virtual   [--ranks 4] [--sizes 16MB,256MB] [--json OUT]
                                                                                     (one GPU)
    python -m echo_jax_tools.bench project   [--preset a100-nvlink3] [--ranks 4,8] [--json OUT]
                                             (no GPU: a projection for P-GPU NVLink machines)

allreduce: the rows of the Echo paper's Table 2 from one run, per message size (bytes per rank):
`lax.psum` (the 16-bit baseline: NCCL on GPUs), the two-collective Echo protocol in pure JAX
(transport "xla") at 8 and 4 bits, the Echo custom call (transport "p2p") at 8 and 4 bits, and the
compensated 4-bit call with the compensator as separate jnp ops around the uncompensated call
("unfused") or inside it ("fused"). Ranks are the local devices under `jax.shard_map` (on CPU the
fake devices of XLA_FLAGS=--xla_force_host_platform_device_count, which the command requests
itself, and the CPU custom call), or with `--virtual` P virtual ranks on one GPU
(`echo_jax.transports.cuda.virtual_allreduce`; there the psum row is a local reduction of the P
rows, not a collective). Every row is checked against the psum row beside its time.

Timing (allreduce, gate, kernels, virtual): each measured op runs inside one jitted
`lax.fori_loop`, chained through an optimization barrier that carries the op's whole output, so
XLA can neither hoist it out of the loop nor drop part of it. The loop's trip count is static (one
program for `--warmup`, one for `--iters`): a first loop of `--warmup` iterations (it also
compiles), then `--repeats` loops of `--iters` iterations, each timed by the host clock around the
loop and `block_until_ready`. The per-call time of a loop is its time divided by its calls,
and the reported time is the median over the loops. Dispatch is thus amortised over the loop and
the host does not wait between calls. `kernels` runs 8 calls an iteration on 8 different inputs
(`--calls-per-iteration`), so the loop's own cost per iteration (a few microseconds on a GPU)
is shared by 8 calls of a kernel that takes 50-150 us.

Every JSON starts with the run's "command", "commit" and "device" (`echo_jax_tools.provenance`;
for `project`, which computes nothing on a device, `projection.NO_DEVICE`).

The end-to-end benchmark of a `models` preset (time to first token and training step per
all-reduce mode) is `python -m models.bench_e2e`: the tools do not import the models.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import echo_jax as ej
from echo_jax import collective
from echo_jax import compensator as comp
from echo_jax._cli import (SIZE_ALIASES, format_size, parse_size,  # noqa: F401 - bench.parse_size
                           parse_sizes, positive_int, request_host_devices, write_json)
from echo_jax.transports import cuda
from echo_jax_tools import projection, provenance

#: The module run, as a results JSON's "command" names it.
PROGRAM = "echo_jax_tools.bench"

#: Rows of `bench allreduce`, in the order they are run and printed.
ROWS = ("psum", "xla8", "xla4", "p2p8", "p2p4", "p2p4-rot", "p2p4-rescale", "p2p4-comp-unfused",
        "p2p4-comp-fused", "p2p4-comp-separate", "p2p4-comp-fused-bf16state",
        "p2p4-comp-fused-int8state", "p2p4-comp-fused-int8state-local",
        "p2p4-comp-fused-int4state-local", "p2p4-comp-fused-rot")

ROW_LABELS = {
    "psum": "lax.psum (16-bit baseline)",
    "xla8": "two-collective 8-bit (transport xla)",
    "xla4": "two-collective 4-bit (transport xla)",
    "p2p8": "Echo custom call 8-bit",
    "p2p4": "Echo custom call 4-bit (echo_psum's default call)",
    "p2p4-rescale": "4-bit, rescale=True (Sec. 5.4 power-of-two rescaling: max |x| + scalar pmax)",
    "p2p4-comp-unfused": "4-bit + compensator as separate ops",
    "p2p4-comp-fused": "4-bit + compensator fused",
    "p2p4-comp-separate": "4-bit + compensator, apply fused, update as its own op "
                          "(state_update='separate')",
    "p2p4-comp-fused-bf16state": "4-bit + compensator fused, bf16 state (state_dtype='bfloat16')",
    "p2p4-comp-fused-int8state": "4-bit + compensator fused, int8 state (state_dtype='int8')",
    "p2p4-comp-fused-int8state-local": "4-bit + compensator fused, int8 state, local residual "
                                       "(residual='local')",
    "p2p4-comp-fused-int4state-local": "4-bit + compensator fused, int4 state, local residual "
                                       "(state_dtype='int4', residual='local')",
    "p2p4-rot": "4-bit, Hadamard rotation (rotation='hadamard')",
    "p2p4-comp-fused-rot": "4-bit + compensator fused, Hadamard rotation",
}

#: Rows whose threshold the gate reports by default, best first.
GATE_ROWS = ("p2p4-comp-fused", "p2p4", "xla4")

#: Estimated bytes of device memory per byte of message in a measured row (inputs, compensator
#: state, the psum reference, the loop's carry and the op's temporaries); sizes above the
#: budget are skipped.
MEMORY_FACTOR = 16


# --------------------------------------------------------------------------------------------
# Sizes and names


def device_tag(device) -> str:
    """Short lower-case name of a device kind: "cpu", "h200", "a100", ..."""
    if device.platform == "cpu":
        return "cpu"
    words = re.sub(r"(?i)\bnvidia\b|\btesla\b", " ", str(device.device_kind)).lower().split()
    tag = re.sub(r"[^a-z0-9]", "", words[0]) if words else ""
    return tag or device.platform


def machine_name(device, ranks: int, *, virtual: bool = False, simulated: bool = False) -> str:
    """Name of the setup in default output paths: "cpu8", "h200x4", "h200x1-virtual4", ...

    Args:
      device: a device of the run (its kind names the machine).
      ranks: the ranks P.
      virtual: P virtual ranks of the CUDA custom call on one device.
      simulated: P ranks simulated by jax.vmap on one device.

    Returns:
      The name.
    """
    tag = device_tag(device)
    sep = "" if tag == "cpu" else "x"
    if virtual:
        return f"{tag}{sep}1-virtual{ranks}"
    if simulated:
        return f"{tag}{sep}1-vmap{ranks}"
    return f"{tag}{sep}{ranks}"


# --------------------------------------------------------------------------------------------
# Timing


def timing_loop(fn, carry_state: bool = False):
    """The jitted timing program of `time_op_stats`: loop(xs, n) runs n iterations (the first
    one starts the carry), each calling fn once on every input of the tuple xs (K calls), or
    once on (x, m1, m2) with carry_state. Returns the last iteration's outputs."""

    def calls(vs):
        return tuple(fn(v) for v in vs)

    def body(_, carry):
        v, out = carry
        if carry_state:
            v = (v, out[1], out[2])  # the old state dies here: donated to this call
            return lax.optimization_barrier((v[0], fn(v)))
        # The whole output is carried, so XLA must compute all of it; the barrier makes the next
        # input depend on it, so nothing is hoisted out of the loop.
        return lax.optimization_barrier((v, calls(v)))

    def run(v, n):
        # The first call starts the carry, so the carry has the output's shardings.
        carry = lax.optimization_barrier((v[0], fn(v)) if carry_state else (v, calls(v)))
        # Not unrolled: with lax.fori_loop(..., unroll=8) XLA ran the op about once per body on
        # the H200 (a 256 MiB p2p4 call "took" 18 us): the K calls of an iteration take K
        # different inputs instead. The loop counter's kernels add a few us an iteration
        # (256 MiB quantize at K = 1: 86.7 us in this loop, 81.4 us when the host dispatches the
        # calls back to back).
        # Every output leaves the program: an output nothing reads would be dropped from the
        # loop (XLA removes dead loop-carried values), and its call with it.
        return lax.fori_loop(1, n, body, carry)[1]

    return jax.jit(run, static_argnums=1)


def time_op_stats(fn, x, iters: int, repeats: int, warmup: int | None = None,
                  carry_state: bool = False, calls_per_iteration: int = 1,
                  baseline=None) -> dict:
    """Time fn(x) in device-side loops (see the module docstring).

    Args:
      fn: a jax-traceable function of x (a pytree); its output may be a pytree.
      x: the input, reused by every call.
      iters: loop iterations per timed loop.
      repeats: timed loops.
      warmup: iterations of the first, untimed loop (it also compiles); default `iters`.
      carry_state: x is (x, m1, m2) and fn returns (y, m1', m2') (a compensated all-reduce):
        each call takes the state the previous call returned, and nothing else keeps that state
        alive, as a model's scan carry does; so XLA may update it in place (the custom call's
        input_output_aliases) instead of copying it on every call.
      calls_per_iteration: K calls of fn per loop iteration, on K inputs of x's shape with
        different contents (x and x rolled by 1..K-1 along each array's first axis; identical
        inputs would be merged into one call), so the loop's own cost per iteration (its
        counter and predicate, a few microseconds on a GPU) is shared by K calls. Not with
        carry_state.
      baseline: None, or (fn_b, x_b): a second op timed in a loop of its own (the same iters,
        one call an iteration) right before each of fn's timed loops, so that the two are
        paired and a drift of the device's speed over the run enters both (`bench allreduce
        --next-matmul`: the multiplication alone, before the call and the multiplication).

    Returns:
      dict(median_s, min_s, max_s, loop_s): seconds per call, and each loop's per-call time;
      with a baseline also baseline_s (its median per call), baseline_loop_s and paired_diff_s,
      the median over the repeats of fn's loop minus the baseline loop before it, per call.
    """
    iters, repeats = max(1, int(iters)), max(1, int(repeats))
    warmup = iters if warmup is None else max(1, int(warmup))
    k_calls = max(1, int(calls_per_iteration))
    if carry_state and k_calls > 1:
        raise ValueError("time_op_stats: calls_per_iteration > 1 does not take carry_state")

    # A static trip count: with a traced one every iteration cost extra time between calls (one
    # H200, 256 MiB: quantize 111 against 90 us a call, copy 171 against 143 us), likely the loop
    # predicate checked on the host each iteration.
    loop = timing_loop(fn, carry_state)
    if not carry_state:  # the K inputs, made before (outside) the timed programs
        x = (x,) if k_calls == 1 else jax.jit(lambda v: tuple(
            jax.tree.map(lambda a, i=i: jnp.roll(a, i, axis=0) if a.ndim else a, v)
            for i in range(k_calls)))(x)
    warm = loop.lower(x, warmup).compile()
    jax.block_until_ready(warm(x))
    # The timed program is compiled before the clock starts (a trip count other than warmup's is
    # another program; compiling it inside the first timed loop made that loop an outlier).
    timed = warm if iters == warmup else loop.lower(x, iters).compile()
    if baseline is not None:
        fn_b, x_b = baseline
        x_b = (x_b,)
        loop_b = timing_loop(fn_b)
        warm_b = loop_b.lower(x_b, warmup).compile()
        jax.block_until_ready(warm_b(x_b))
        timed_b = warm_b if iters == warmup else loop_b.lower(x_b, iters).compile()
    times, base_times = [], []
    for _ in range(repeats):
        if baseline is not None:
            t0 = time.perf_counter()
            jax.block_until_ready(timed_b(x_b))
            base_times.append((time.perf_counter() - t0) / iters)
        t0 = time.perf_counter()
        jax.block_until_ready(timed(x))
        times.append((time.perf_counter() - t0) / (iters * k_calls))
    out = dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
               loop_s=times)
    if baseline is not None:
        out.update(baseline_s=statistics.median(base_times), baseline_loop_s=base_times,
                   paired_diff_s=statistics.median(t - b for t, b in zip(times, base_times)))
    return out


def time_op(fn, x, iters: int, repeats: int, warmup: int | None = None,
            calls_per_iteration: int = 1) -> float:
    """Median seconds per call of fn(x) (`time_op_stats`' median_s)."""
    return time_op_stats(fn, x, iters, repeats, warmup,
                         calls_per_iteration=calls_per_iteration)["median_s"]


def timing_note(iters: int, warmup: int, repeats: int) -> str:
    """How `time_op_stats` timed, for the JSON output."""
    return (f"device-side loop: each row runs inside one jitted lax.fori_loop with a static "
            f"trip count (an optimization barrier carries the whole output); one untimed loop "
            f"of {warmup} iterations "
            f"(warm-up and compilation), then {repeats} loops of {iters} iterations, each timed "
            "by the host clock around the loop with block_until_ready; median_s is the median "
            "over the loops of loop time / iterations")


def _memory_budget(devices, virtual: bool) -> tuple:
    """(bytes available to one rank's message, what the budget is) for the size check."""
    dev = devices[0]
    if dev.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
            total = info.get("MemAvailable", info["MemTotal"])
        except (OSError, KeyError, ValueError, IndexError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // len(devices), "host memory available, shared by the CPU ranks"
    try:
        limit = dev.memory_stats()["bytes_limit"]
    except Exception:  # noqa: BLE001 - a backend without memory stats: no check
        return None, "unknown"
    return limit, "memory of one device"


# --------------------------------------------------------------------------------------------
# allreduce: the rows


def _configs():
    return {"xla8": ej.EchoConfig(bits=8, transport="xla"),
            "xla4": ej.EchoConfig(bits=4, transport="xla"),
            "p2p8": ej.EchoConfig(bits=8, transport="p2p"),
            "p2p4": ej.EchoConfig(bits=4, transport="p2p"),
            "comp": ej.EchoConfig(bits=4, transport="p2p"),
            "comp-bf16state": ej.EchoConfig(bits=4, transport="p2p", state_dtype="bfloat16"),
            "comp-int8state": ej.EchoConfig(bits=4, transport="p2p", state_dtype="int8"),
            "comp-int8state-local": ej.EchoConfig(bits=4, transport="p2p", state_dtype="int8",
                                                  residual="local"),
            "comp-int4state-local": ej.EchoConfig(bits=4, transport="p2p", state_dtype="int4",
                                                  residual="local"),
            "comp-separate": ej.EchoConfig(bits=4, transport="p2p", state_update="separate"),
            "p2p4-rot": ej.EchoConfig(bits=4, transport="p2p", rotation="hadamard")}


def _mesh_rows(mesh, ranks: int):
    """Per-row functions of global [P, n] inputs under jax.shard_map (one rank per device).

    Returns:
      dict row -> (fn, state): fn maps x (or (x, m1, m2) when compensated) to the per-rank
      results stacked [P, ...] (and the new states); state is None for an uncompensated row,
      else the dtype name of its m1, m2.
    """
    cfgs = _configs()
    k = comp.Coefficients.from_config(cfgs["comp"])

    def wrap(body, nargs, nout):
        # check_vma=False: per-rank program semantics, as in models.model.
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS("tp"),) * nargs,
                                     out_specs=PS("tp") if nout == 1 else (PS("tp"),) * nout,
                                     check_vma=False))

    def plain(cfg, rescale=False):
        # The paper's rows run unscaled (rescale=False, the bits and the program of echo_psum's
        # default rescale="auto"); p2p4-rescale is rescale=True.
        return wrap(lambda x: ej.echo_psum(x[0], "tp", config=cfg, rescale=rescale)[None], 1, 1)

    def unfused(x, m1, m2):
        # The compensator as separate jnp passes around the uncompensated custom call, with
        # echo_psum's own arithmetic (so the result equals the fused call bit for bit).
        x32 = x[0].astype(jnp.float32)
        state = comp.CompensatorState(m1[0], m2[0])
        xp = comp.apply_correction(x32, state, k)
        y32 = ej.echo_psum(xp, "tp", config=cfgs["comp"], rescale=False)
        new = comp.update_state(xp, y32, ranks, state, k)
        return y32.astype(x.dtype)[None], new.m1[None], new.m2[None]

    def fused(x, m1, m2, cfg=cfgs["comp"]):
        # The [1, n] blocks as they are: squeezing m1, m2 around the call that updates them in
        # place made XLA copy them before and after every call of the timed loop.
        y, new = ej.echo_psum(x, "tp", config=cfg, state=comp.CompensatorState(m1, m2),
                              rescale=False)
        return y, new.m1, new.m2

    def fused_int8(x, m1, m2, cfg=cfgs["comp-int8state"]):
        # A rank's block of the int8 state: codes [1, n], scales [groups] (the global scales
        # flat, `stored_state(..., flat_scales=True)`): [1, groups] blocks squeezed around the
        # call that updates them in place made XLA copy both scales before and after every call
        # of the timed loop.
        y, new = ej.echo_psum(x, "tp", config=cfg, state=comp.CompensatorState(m1, m2),
                              rescale=False)
        return (y,) + tuple(new)

    rows = {"psum": (wrap(lambda x: lax.psum(x[0], "tp")[None], 1, 1), None)}
    for name in ("xla8", "xla4", "p2p8", "p2p4", "p2p4-rot"):
        rows[name] = (plain(cfgs[name]), None)
    rows["p2p4-rescale"] = (plain(cfgs["p2p4"], True), None)
    f_unfused, f_fused = wrap(unfused, 3, 3), wrap(fused, 3, 3)
    f_fused_rot = wrap(functools.partial(fused, cfg=cfgs["p2p4-rot"]), 3, 3)
    f_fused_bf16 = wrap(functools.partial(fused, cfg=cfgs["comp-bf16state"]), 3, 3)
    f_separate = wrap(functools.partial(fused, cfg=cfgs["comp-separate"]), 3, 3)
    rows["p2p4-comp-unfused"] = (lambda v: f_unfused(*v), "float32")
    rows["p2p4-comp-fused"] = (lambda v: f_fused(*v), "float32")
    rows["p2p4-comp-separate"] = (lambda v: f_separate(*v), "float32")
    rows["p2p4-comp-fused-bf16state"] = (lambda v: f_fused_bf16(*v), "bfloat16")
    f_fused_int8 = wrap(fused_int8, 3, 3)
    rows["p2p4-comp-fused-int8state"] = (lambda v: f_fused_int8(*v), "int8")
    f_fused_local = wrap(functools.partial(fused_int8, cfg=cfgs["comp-int8state-local"]), 3, 3)
    rows["p2p4-comp-fused-int8state-local"] = (lambda v: f_fused_local(*v), "int8")
    f_fused_q4 = wrap(functools.partial(fused_int8, cfg=cfgs["comp-int4state-local"]), 3, 3)
    rows["p2p4-comp-fused-int4state-local"] = (lambda v: f_fused_q4(*v), "int4")
    rows["p2p4-comp-fused-rot"] = (lambda v: f_fused_rot(*v), "float32")
    return rows


def _virtual_rows(ranks: int):
    """Per-row functions of [P, n] inputs on one GPU (P virtual ranks); see `_mesh_rows`."""
    cfgs = _configs()
    wire = {name: c.replace(transport="auto") for name, c in cfgs.items()}
    k = comp.Coefficients.from_config(wire["comp"])

    def vmapped(f):
        return jax.jit(jax.vmap(f, axis_name="tp"))

    def unfused(v):
        x, m1, m2 = v
        state = comp.CompensatorState(m1, m2)
        xp = comp.apply_correction(x.astype(jnp.float32), state, k)
        y32 = cuda.virtual_allreduce(xp, wire["comp"])
        new = comp.update_state(xp, y32, ranks, state, k)
        return y32.astype(x.dtype), new.m1, new.m2

    def fused(v, cfg=wire["comp"]):
        x, m1, m2 = v
        y, new = cuda.virtual_allreduce(x, cfg, comp.CompensatorState(m1, m2))
        return y, new.m1, new.m2

    rows = {"psum": (vmapped(lambda r: lax.psum(r, "tp")), None)}
    for name in ("xla8", "xla4"):
        rows[name] = (vmapped(lambda r, c=cfgs[name]: ej.echo_psum(r, "tp", config=c,
                                                                   rescale=False)), None)
    for name in ("p2p8", "p2p4", "p2p4-rot"):
        rows[name] = (jax.jit(lambda v, c=wire[name]: cuda.virtual_allreduce(v, c)), None)

    def rescaled(v):
        # rescale=True: the factor from max |x| and a pmax over the ranks, then the call.
        f = jax.vmap(lambda r: collective.rescale_factor(r, "tp", True), axis_name="tp")(v)
        return cuda.virtual_allreduce(v, wire["p2p4"], factor=f[0])

    rows["p2p4-rescale"] = (jax.jit(rescaled), None)
    rows["p2p4-comp-unfused"] = (jax.jit(unfused), "float32")
    rows["p2p4-comp-fused"] = (jax.jit(fused), "float32")
    rows["p2p4-comp-separate"] = (jax.jit(functools.partial(fused, cfg=wire["comp-separate"])),
                                  "float32")
    rows["p2p4-comp-fused-bf16state"] = (
        jax.jit(functools.partial(fused, cfg=wire["comp-bf16state"])), "bfloat16")
    rows["p2p4-comp-fused-int8state"] = (
        jax.jit(functools.partial(fused, cfg=wire["comp-int8state"])), "int8")
    rows["p2p4-comp-fused-int8state-local"] = (
        jax.jit(functools.partial(fused, cfg=wire["comp-int8state-local"])), "int8")
    rows["p2p4-comp-fused-int4state-local"] = (
        jax.jit(functools.partial(fused, cfg=wire["comp-int4state-local"])), "int4")
    rows["p2p4-comp-fused-rot"] = (jax.jit(functools.partial(fused, cfg=wire["p2p4-rot"])),
                                   "float32")
    return rows


@functools.partial(jax.jit, static_argnames=("state_dtype", "flat_scales"))
def stored_state(m, state_dtype: str, flat_scales: bool = False):
    """A state average m [P, n] (fp32) in a row's state format: the dtype, or the int8 / int4
    state's codes [P, n] and scales [P, groups] (`compensator.quantize_state` per rank; with
    flat_scales [P * groups], a rank's block its [groups], as the mesh rows take them)."""
    if state_dtype in ("int8", "int4"):
        codes, scales = jax.vmap(lambda a: comp.quantize_state(a, state_dtype))(m)
        return comp.QuantizedMoment(codes, scales.reshape(-1) if flat_scales else scales)
    return m.astype(state_dtype)


def with_next_matmul(fn, compensated: bool, w):
    """fn followed by the next layer's matrix multiplication of its sum: y [P, n] as [P, n / D,
    D] times w [D, D] (the Echo paper's Table 2 times the fused row this way, so that the update
    it runs beside that multiplication shows only what it adds). Returns fn's outputs with the
    product in place of y."""

    def f(v):
        out = fn(v)
        y = out[0] if compensated else out
        z = jnp.matmul(y.reshape(y.shape[0], -1, w.shape[0]), w)
        return (z,) + tuple(out[1:]) if compensated else z

    return f


def _row_unavailable(name: str, fn, example, virtual: bool):
    """Why a row cannot run here (None when it can): traces it on `example`."""
    if virtual and name.startswith("p2p"):
        if not cuda.available():
            return "the CUDA custom call (echo_jax._ffi_cuda) or a GPU is missing"
    try:
        jax.eval_shape(fn, example)
    except (ValueError, ImportError, NotImplementedError) as err:
        return str(err).split("\n")[0]
    return None


def bench_allreduce(args) -> dict:
    """Run the all-reduce rows (`ROWS`) at every size and check them against psum.

    Args:
      args: parsed flags: sizes (bytes per rank), ranks (None: all local devices; with virtual:
        4), virtual, rows (None: all that can run), iters, warmup, repeats, dtype, seed,
        memory_check.

    Returns:
      dict(benchmark, machine, device, ranks, timing, notes, rows, skipped). Each row: row,
      size_bytes, ranks, dtype, median_s, min_s, max_s, loop_s, speedup_vs_psum, max_abs_err
      (against the psum row), bit_identical_across_ranks, for the fused row
      bit_identical_to_unfused (result and state), for the separate row with float32 x
      bit_identical_to_fused; with args.next_matmul = D > 0 also next_matmul_dim,
      with_next_matmul_s (the row followed by its sum times a [D, D] matrix, `with_next_matmul`),
      next_matmul_s (the multiplication alone) and added_to_next_matmul_s (their difference:
      what the call adds to the critical path when its update may run beside the
      multiplication).
    """
    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()
    if args.virtual:
        if devices[0].platform != "gpu":
            raise ValueError("--virtual needs a GPU (P virtual ranks of the CUDA custom call "
                             "on one device)")
        ranks = args.ranks or 4
        mesh, devices = None, devices[:1]
    else:
        ranks = args.ranks or len(devices)
        if ranks > len(devices):
            raise ValueError(f"--ranks {ranks} but only {len(devices)} devices; on CPU set "
                             "XLA_FLAGS=--xla_force_host_platform_device_count, on one GPU "
                             "use --virtual")
        devices = devices[:ranks]
        mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
    machine = machine_name(devices[0], ranks, virtual=args.virtual)
    wanted = list(ROWS) if args.rows is None else list(args.rows)
    if "psum" not in wanted:
        wanted.insert(0, "psum")  # the reference of every row's error and speedup
    budget, budget_what = _memory_budget(devices, args.virtual)
    per_size_factor = MEMORY_FACTOR * (ranks if args.virtual else 1)
    mm_dim = int(getattr(args, "next_matmul", 0) or 0)
    if mm_dim:
        bad = [s for s in args.sizes if (max(1, s // dtype.itemsize)) % mm_dim]
        if bad:
            raise ValueError(f"--next-matmul {mm_dim}: the values a rank of sizes "
                             f"{[format_size(s) for s in bad]} are not a multiple of {mm_dim}")

    ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    rows, skipped, unavailable = [], [], {}
    with ctx:
        table = _virtual_rows(ranks) if args.virtual else _mesh_rows(mesh, ranks)
        sharding = None if mesh is None else NamedSharding(mesh, PS("tp"))

        def place(a):
            return jnp.asarray(a) if sharding is None else jax.device_put(a, sharding)

        check = jax.jit(_compare)
        example = jax.ShapeDtypeStruct((ranks, 1024), dtype, sharding=sharding)
        def example_c(state_dtype):
            m = jax.eval_shape(functools.partial(stored_state, state_dtype=state_dtype,
                                                 flat_scales=not args.virtual),
                               jax.ShapeDtypeStruct((ranks, 1024), jnp.float32))
            m = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=sharding), m)
            return (example, m, m)

        for name in wanted:
            fn, state_dtype = table[name]
            reason = _row_unavailable(name, fn, example if state_dtype is None
                                      else example_c(state_dtype), args.virtual)
            if reason is not None:
                unavailable[name] = reason
                print(f"note: row {name} cannot run here: {reason}", file=sys.stderr)
        for size in args.sizes:
            need = per_size_factor * size
            if args.memory_check and budget is not None and need > budget:
                skipped.append(dict(size_bytes=size, reason=(
                    f"needs about {need / 2**30:.1f} GiB ({MEMORY_FACTOR} x the message"
                    f"{' x P' if args.virtual else ''}), {budget_what}: "
                    f"{budget / 2**30:.1f} GiB (--no-memory-check runs it anyway)")))
                print(f"note: size {format_size(size)} skipped: {skipped[-1]['reason']}",
                      file=sys.stderr)
                continue
            n = max(1, size // dtype.itemsize)
            x = place(jax.random.normal(jax.random.key(args.seed), (ranks, n), jnp.float32)
                      .astype(dtype))
            # The compensated rows are timed and compared with each other from the state left
            # by one call on x (a live state); their error against psum is that of a call with
            # a zero state (the first site of a pass), since a live correction moves the result
            # away from this call's exact sum on purpose.
            zeros = place(jnp.zeros((ranks, n), jnp.float32))
            if args.virtual:
                # The device's streaming bandwidth at this size (x * 2 over all P rows: read +
                # write), which turns each row's byte floor into a time floor.
                copy_s = time_op(lambda v: v * 2.0, zeros, args.iters, args.repeats)
                copy_bps = 2 * zeros.size * 4 / copy_s
            if mm_dim:
                w = place(jax.random.normal(jax.random.key(args.seed + 1), (ranks, mm_dim, mm_dim),
                                            jnp.float32).astype(dtype) / np.sqrt(mm_dim))[0]
                def matmul(v, w=w):
                    return jnp.matmul(v.reshape(v.shape[0], -1, mm_dim), w)
            m1, m2 = zeros, zeros
            for cname in ("p2p4-comp-unfused", "p2p4-comp-fused"):
                if cname in wanted and cname not in unavailable:
                    _, m1, m2 = table[cname][0]((x, zeros, zeros))
                    break
            ref = None
            outputs = {}
            for name in wanted:
                if name in unavailable:
                    continue
                fn, state_dtype = table[name]
                compensated = state_dtype is not None
                # A bf16 / int8-state row starts from the same state, stored in its format
                # (outside the timing).
                st = ([stored_state(a, state_dtype, flat_scales=not args.virtual)
                       for a in (m1, m2, zeros)] if compensated else None)
                inp = (x, st[0], st[1]) if compensated else x
                stats = time_op_stats(fn, inp, args.iters, args.repeats, args.warmup,
                                      carry_state=compensated)
                out = fn(inp)
                y = fn((x, st[2], st[2]))[0] if compensated else out
                if ref is None:
                    ref = y  # the psum row runs first
                err, identical = (float(v) for v in check(y, ref))
                row = dict(row=name, label=ROW_LABELS[name], size_bytes=size, ranks=ranks,
                           dtype=dtype.name, **stats, max_abs_err=err,
                           bit_identical_across_ranks=bool(identical))
                if args.virtual:
                    floor = byte_floor(name, n, ranks, dtype.itemsize)
                    row.update(floor_bytes=floor, floor_s=floor / copy_bps,
                               vs_floor=stats["median_s"] * copy_bps / floor)
                if compensated:
                    outputs[name] = out
                if name == "p2p4-comp-fused" and "p2p4-comp-unfused" in outputs:
                    row["bit_identical_to_unfused"] = all(
                        bool(np.array_equal(np.asarray(a), np.asarray(b)))
                        for a, b in zip(out, outputs["p2p4-comp-unfused"]))
                if (name == "p2p4-comp-separate" and "p2p4-comp-fused" in outputs
                        and dtype == jnp.float32):
                    row["bit_identical_to_fused"] = all(
                        bool(np.array_equal(np.asarray(a), np.asarray(b)))
                        for a, b in zip(out, outputs["p2p4-comp-fused"]))
                if mm_dim:
                    both = time_op_stats(with_next_matmul(fn, compensated, w), inp, args.iters,
                                         args.repeats, args.warmup, carry_state=compensated,
                                         baseline=(matmul, x))
                    row.update(next_matmul_dim=mm_dim, with_next_matmul_s=both["median_s"],
                               next_matmul_s=both["baseline_s"],
                               added_to_next_matmul_s=both["paired_diff_s"],
                               with_next_matmul_loop_s=both["loop_s"],
                               next_matmul_loop_s=both["baseline_loop_s"])
                rows.append(row)
                print(f"  {format_size(size):>6} {name:<18} {stats['median_s'] * 1e3:10.4f} ms"
                      f"  err {err:.3g}", file=sys.stderr, flush=True)
            base = {r["row"]: r["median_s"] for r in rows if r["size_bytes"] == size}
            for r in rows:
                if r["size_bytes"] == size:
                    r["speedup_vs_psum"] = base["psum"] / r["median_s"]
            del x, m1, m2, zeros, ref, outputs
            if mm_dim:
                del w
    notes = ["max_abs_err: max over every rank and element of |row - psum row|, in the row's "
             "dtype; bit_identical_across_ranks: every rank returned the same bits",
             "compensated rows are timed with the state each call returns fed to the next "
             "(donated, as a model's scan carry does), starting from the state left by one "
             "earlier call on the same input; bit_identical_to_unfused compares the fused row's "
             "result and new state with the unfused row's from that starting state; their "
             "max_abs_err is that of a call with a zero state (the first site of a pass)"]
    if mm_dim:
        notes.append(f"with_next_matmul_s: the row followed by the next layer's multiplication "
                     f"of its sum ([P, n / {mm_dim}, {mm_dim}] times a [{mm_dim}, {mm_dim}] "
                     "matrix) in the same timed loop; next_matmul_s: the multiplication alone, "
                     "timed in a loop of its own right before each of those loops (the pairs "
                     "in next_matmul_loop_s, with_next_matmul_loop_s); added_to_next_matmul_s: "
                     "the median over the pairs of the difference: what the call adds to the "
                     "critical path, the Echo paper's Table 2 method for its fused row, where the "
                     "state "
                     "update may run beside the multiplication (state_update='separate', on a "
                     "second GPU stream)")
    if args.virtual:
        notes.append("floor_s: the row's byte floor (`byte_floor`: bytes every virtual rank "
                     "must read and write at least) at the streaming bandwidth of x * 2 measured "
                     "at the same size; vs_floor = median_s / floor_s")
    if args.virtual:
        notes.append("P virtual ranks share one GPU (no interconnect; all traffic is local "
                     "memory); the psum row is a vmap psum (a local reduction of the P rows), "
                     "the xla rows the pure-JAX protocol under vmap: not a multi-GPU all-reduce")
    elif devices[0].platform == "cpu":
        notes.append("CPU fake devices: the ranks are host threads sharing the machine's cores "
                     "and memory; the p2p rows use the CPU custom call. Not representative of "
                     "GPU interconnects")
    return dict(benchmark="allreduce", machine=machine, device=provenance.device_name(devices),
                platform=devices[0].platform, ranks=ranks, virtual=bool(args.virtual),
                dtype=dtype.name, sizes=list(args.sizes),
                timing=timing_note(args.iters, args.warmup, args.repeats), notes=notes,
                rows=rows, unavailable_rows=unavailable, skipped_sizes=skipped)


def byte_floor(row: str, n: int, ranks: int, itemsize: int) -> int:
    """Bytes of device memory that all P virtual ranks of a row must read and write at least.

    Per rank and element of an itemsize-byte contribution, with w wire bytes per element
    (`projection.wire_bytes_per_element`, g = 128, asym): x is read once and y written once (2 itemsize);
    the codes are written by the push ((P-1)/P of the message), read by the owners' reduce
    ((P-1)/P), written by the gather into every rank's slot (1) and read by the tail ((P-1)/P):
    w (3 (P-1)/P + 1). The compensated rows add the state: m1, m2 read where x' is formed,
    x, m1, m2 read again and m1, m2 written where y is produced (6 s + itemsize for an s-byte
    state value: 24 + itemsize in fp32, 12 + itemsize in bf16, 6.19 + itemsize in int8 with
    its scales), less the second read of x, m1, m2 in the fused rows' own segment (1/P of the
    values), which the reduce stage can keep from the first (2 s + itemsize over P); the
    separate update also reads y (one more itemsize). With the local residual (rows ending in
    "-local", `EchoConfig.residual="local"`) the state is read once and written once (4 s):
    the push and the reduce update it where they quantize. The rescaled
    row reads x once more for its max (itemsize). psum (a local reduction of the P rows under
    vmap here) reads and writes each row once. The "xla" rows run
    the same protocol, so their floor is the p2p row's of equal bits.
    """
    if row == "psum":
        return 2 * ranks * n * itemsize
    bits = 8 if row in ("xla8", "p2p8") else 4
    w = projection.wire_bytes_per_element(bits)
    per_element = 2 * itemsize + w * (3 * (ranks - 1) / ranks + 1)
    if "comp" in row:
        # int8: a byte a value and a 4-byte scale a 128 values
        state = (2 if "bf16state" in row else 1 + 4 / 128 if "int8state" in row
                 else 0.5 + 4 / 128 if "int4state" in row else 4)
        if row.endswith("-local"):
            # The local residual: m1, m2 read once (where x' is formed) and written once.
            per_element += 4 * state
        else:
            per_element += 6 * state + itemsize
            if "fused" in row:
                per_element -= (2 * state + itemsize) / ranks
    if "separate" in row:
        per_element += itemsize
    if "rescale" in row:
        per_element += itemsize
    return int(round(per_element * n * ranks))


def _compare(y, ref):
    """(max |y - ref|, whether every rank (row of y) holds the same bits as rank 0)."""
    err = jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32)))
    uint = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(y.dtype).itemsize]
    bits = lax.bitcast_convert_type(y, uint)
    return err, jnp.all(bits == bits[:1])


# --------------------------------------------------------------------------------------------
# The size gate


def derive_gate(rows, row: str) -> dict:
    """The size-gate threshold (`EchoConfig.min_bytes`) for one row from a size sweep.

    The threshold is the smallest measured size from which on the row is at least as fast as
    the psum row at every larger measured size; messages below it go to psum. Sizes between two
    measured ones count with the larger (conservative: no measured size is slower than psum).

    Args:
      rows: `bench_allreduce` rows (several sizes, with a psum row per size).
      row: the Echo row to gate.

    Returns:
      dict(row, min_bytes (None when the row is never faster), speedups {size: x}, note).
    """
    speed = {r["size_bytes"]: r["speedup_vs_psum"] for r in rows if r["row"] == row}
    if not speed:
        return dict(row=row, min_bytes=None, speedups={}, note=f"row {row} was not measured")
    sizes = sorted(speed)
    threshold = None
    for s in reversed(sizes):
        if speed[s] < 1.0:
            break
        threshold = s
    if threshold is None:
        note = (f"{row} is slower than psum at the largest measured size "
                f"({format_size(sizes[-1])}); measure larger sizes")
    elif threshold == sizes[0]:
        note = (f"{row} is at least as fast as psum at every measured size; the gate is set at "
                "the smallest one, since smaller messages were not measured")
    else:
        note = (f"{row} is at least as fast as psum from {format_size(threshold)} on; "
                f"EchoConfig(min_bytes={threshold}) sends smaller messages to psum")
    return dict(row=row, min_bytes=threshold, speedups={str(s): speed[s] for s in sizes},
                note=note)


def gate_summary(result: dict, gate_row: str | None) -> dict:
    """Gate thresholds of every measured Echo row and the recommended one (`gate_row`)."""
    measured = [r for r in ROWS if r != "psum" and any(x["row"] == r for x in result["rows"])]
    per_row = {r: derive_gate(result["rows"], r) for r in measured}
    if gate_row is None:
        gate_row = next((r for r in GATE_ROWS if r in per_row), measured[0] if measured else None)
    chosen = per_row.get(gate_row) if gate_row else None
    return dict(row=gate_row, min_bytes=None if chosen is None else chosen["min_bytes"],
                note=None if chosen is None else chosen["note"], per_row=per_row,
                dtype=result["dtype"],
                caveat="bytes per rank in the measured dtype; the crossover depends on the "
                       "machine, P and the dtype, so derive it on the machine that runs the model")


# --------------------------------------------------------------------------------------------
# Output: table and plot


def format_allreduce_table(result: dict) -> str:
    """The rows as a text table (one line per size and row)."""
    head = ("size/rank", "row", "median", "speedup", "max|err|", "identical", "byte floor")
    widths = (9, 18, 12, 8, 10, 9, 20)
    lines = [f"all-reduce on {result['machine']} ({result['device']}), P={result['ranks']}, "
             f"{result['dtype']}",
             "  ".join(h.rjust(w) if i != 1 else h.ljust(w)
                       for i, (h, w) in enumerate(zip(head, widths))),
             "  ".join("-" * w for w in widths)]
    for r in result["rows"]:
        ms = r["median_s"] * 1e3
        t = f"{ms:.3f} ms" if ms < 1e3 else f"{ms / 1e3:.3f} s"
        floor = (f"{r['floor_s'] * 1e3:.3f} ms ({r['vs_floor']:.2f}x)" if "floor_s" in r
                 else "-")
        cells = (format_size(r["size_bytes"]), r["row"], t, f"{r['speedup_vs_psum']:.2f}x",
                 f"{r['max_abs_err']:.3g}", "yes" if r["bit_identical_across_ranks"] else "NO",
                 floor)
        lines.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))
    added = [r for r in result["rows"] if "added_to_next_matmul_s" in r]
    if added:
        lines.append(f"beside the next matmul (D={added[0]['next_matmul_dim']}): the call's "
                     "time added to the multiplication's")
    for r in added:
        lines.append(f"  {format_size(r['size_bytes']):>9}  {r['row']:<18}  added "
                     f"{r['added_to_next_matmul_s'] * 1e3:.3f} ms (alone "
                     f"{r['median_s'] * 1e3:.3f} ms; matmul {r['next_matmul_s'] * 1e3:.3f} ms)")
    for name, why in result.get("unavailable_rows", {}).items():
        lines.append(f"not run: {name}: {why}")
    for s in result.get("skipped_sizes", []):
        lines.append(f"not run: {format_size(s['size_bytes'])}: {s['reason']}")
    gate = result.get("gate")
    if gate:
        lines.append(f"size gate ({gate['row']}): min_bytes = {gate['min_bytes']}  "
                     f"({gate['note']})")
    return "\n".join(lines)


def plot_allreduce(result: dict, path: str) -> None:
    """Latency and speedup over psum against the message size, one line per row (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ROWS:
        pts = sorted((r["size_bytes"], r["median_s"], r["speedup_vs_psum"])
                     for r in result["rows"] if r["row"] == name)
        if not pts:
            continue
        s = [p[0] for p in pts]
        style = dict(marker="o", label=name, linestyle="--" if name == "psum" else "-")
        ax1.plot(s, [p[1] * 1e3 for p in pts], **style)
        ax2.plot(s, [p[2] for p in pts], **style)
    sizes = sorted({r["size_bytes"] for r in result["rows"]})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("message size per rank")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("median latency (ms)")
    ax2.axhline(1.0, color="gray", linewidth=1)
    ax2.set_ylabel("speedup over psum (x)")
    ax1.legend(fontsize=8)
    fig.suptitle(f"all-reduce, {result['machine']} ({result['device']}), P={result['ranks']}, "
                 f"{result['dtype']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)



# --------------------------------------------------------------------------------------------
# kernels and virtual (one GPU)


def bench_kernels(args) -> dict:
    """Quantize / dequantize throughput of the CUDA kernels against a copy, on one GPU.

    Args:
      args: parsed flags: sizes (bytes), iters, repeats.

    Returns:
      dict(benchmark, device, rows): per op, seconds, bytes moved, GB/s and % of the copy's.
    """
    rows = []
    for size in args.sizes:
        n = size // 4
        n -= n % 128
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        k_calls = args.calls_per_iteration
        copy_s = time_op(lambda v: v * 2.0, x, args.iters, args.repeats,
                         calls_per_iteration=k_calls)
        copy_bw = 8 * n / copy_s  # read 4 B + write 4 B per value
        rows.append(dict(op="copy (x*2)", dtype="float32", size_bytes=size, seconds=copy_s,
                         bytes_moved=8 * n, gbps=copy_bw / 1e9, pct_of_copy=100.0))
        for bits in (4, 8):
            cfg = ej.EchoConfig(bits=bits)
            wire = n // 128 * (128 * bits // 8 + 4)
            for dtype in (jnp.float32, jnp.bfloat16):
                xd = x.astype(dtype)
                q_s = time_op(lambda v: cuda.quantize(v, cfg), xd, args.iters, args.repeats,
                              calls_per_iteration=k_calls)
                moved = n * jnp.dtype(dtype).itemsize + wire
                rows.append(dict(op=f"quantize {bits}-bit", dtype=jnp.dtype(dtype).name,
                                 size_bytes=size, seconds=q_s, bytes_moved=moved,
                                 gbps=moved / q_s / 1e9, pct_of_copy=100 * moved / q_s / copy_bw))
            packed, params = jax.jit(lambda v: cuda.quantize(v, cfg))(x)
            d_s = time_op(lambda p: cuda.dequantize(p[0], p[1], cfg), (packed, params),
                          args.iters, args.repeats, calls_per_iteration=k_calls)
            moved = wire + 4 * n
            rows.append(dict(op=f"dequantize {bits}-bit", dtype="float32", size_bytes=size,
                             seconds=d_s, bytes_moved=moved, gbps=moved / d_s / 1e9,
                             pct_of_copy=100 * moved / d_s / copy_bw))
        # rotation="hadamard" adds one rotation before quantizing and one inverse after the sum,
        # as XLA ops (a log2(g)-stage butterfly per group), each reading and writing n fp32 values.
        for op, fn in (("hadamard rotate g128 (XLA)", ej.hadamard_rotate),
                       ("hadamard unrotate g128 (XLA)", ej.hadamard_unrotate)):
            r_s = time_op(lambda v, fn=fn: fn(v, 128), x, args.iters, args.repeats,
                          calls_per_iteration=k_calls)
            rows.append(dict(op=op, dtype="float32", size_bytes=size, seconds=r_s,
                             bytes_moved=8 * n, gbps=8 * n / r_s / 1e9,
                             pct_of_copy=100 * 8 * n / r_s / copy_bw))
    timing = (timing_note(args.iters, args.iters, args.repeats) +
              f"; {args.calls_per_iteration} calls of the op per iteration on different inputs "
              "(seconds is per call)")
    return {"benchmark": "kernels", "device": provenance.device_name(jax.devices()[:1]),
            "timing": timing, "rows": rows}


def bench_virtual(args) -> dict:
    """The all-reduce rows on P virtual ranks of one GPU, against the xla 4-bit row.

    Args:
      args: parsed flags: sizes (bytes per rank), ranks, iters, repeats.

    Returns:
      dict(benchmark, ranks, device, note, rows); `allreduce --virtual` is the fuller table.
    """
    P = args.ranks
    rows = []
    for size in args.sizes:
        n = size // 4
        x = jax.random.normal(jax.random.key(1), (P, n), jnp.float32)
        state = ej.init_state(x)
        exact = np.asarray(x, np.float64).sum(0)

        def xla(v, bits):
            cfg = ej.EchoConfig(bits=bits, transport="xla")
            return jax.vmap(lambda r: ej.echo_psum(r, "tp", config=cfg, rescale=False),
                            axis_name="tp")(v)

        def p2p(v, bits):
            return cuda.virtual_allreduce(v, ej.EchoConfig(bits=bits))

        def fused(v):
            return cuda.virtual_allreduce(v, ej.EchoConfig(bits=4), state)

        def unfused(v):
            # The compensator as separate jnp passes around the uncompensated custom call.
            cfg = ej.EchoConfig(bits=4)
            k = comp.Coefficients.from_config(cfg)
            xp = comp.apply_correction(v, state, k)
            y = cuda.virtual_allreduce(xp, cfg)
            return y, comp.update_state(xp, y, P, state, k)

        cases = [("xla 8-bit", lambda v: xla(v, 8)), ("xla 4-bit", lambda v: xla(v, 4)),
                 ("p2p 8-bit", lambda v: p2p(v, 8)), ("p2p 4-bit", lambda v: p2p(v, 4)),
                 ("p2p 4-bit comp unfused", unfused), ("p2p 4-bit comp fused", fused)]
        base = None
        for name, fn in cases:
            s = time_op(fn, x, args.iters, args.repeats)
            y = np.asarray(jax.tree.leaves(jax.jit(fn)(x))[0])
            if name == "xla 4-bit":
                base = s
            rows.append(dict(row=name, size_bytes=size, ranks=P, median_s=s,
                             max_abs_err=float(np.abs(y[0] - exact).max()),
                             bit_identical_across_ranks=bool((y == y[0]).all())))
        for r in rows:
            if r["size_bytes"] == size:
                r["speedup_vs_xla4"] = base / r["median_s"]
    return {"benchmark": "virtual", "ranks": P,
            "device": provenance.device_name(jax.devices()[:1]),
            "note": "P virtual ranks share one GPU: no NVLink, all traffic is local HBM; "
                    "not representative of a multi-GPU all-reduce", "rows": rows}


# --------------------------------------------------------------------------------------------
# Command line


def _sizes_arg(text: str) -> list:
    try:
        return parse_sizes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rows_arg(text: str) -> list:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"unknown rows {bad}; choose from {','.join(ROWS)}")
    return [r for r in ROWS if r in rows]


def _add_allreduce_args(p, gate: bool) -> None:
    p.add_argument("--sizes", type=_sizes_arg, default=parse_sizes("small" if gate else
                                                                   "small,large"),
                   help="message sizes per rank: a comma list of sizes (64KB, 16MB, 1GB) and "
                        f"aliases small ({SIZE_ALIASES['small']}) and large "
                        f"({SIZE_ALIASES['large']}). Default: "
                        f"{'small' if gate else 'small,large'}")
    p.add_argument("--ranks", type=positive_int, default=None, metavar="P",
                   help="ranks P (default: all local devices; 8 fake devices on CPU; 4 with "
                        "--virtual)")
    p.add_argument("--virtual", action="store_true",
                   help="P virtual ranks of the CUDA custom call on one GPU")
    p.add_argument("--rows", type=_rows_arg, default=None,
                   help=f"rows to run, from {','.join(ROWS)} (default: all that can run here"
                        f"{', of psum and ' + ','.join(GATE_ROWS) if gate else ''}; psum always "
                        "runs, as the reference)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the contributions (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=80,
                   help="calls per timed loop (default: %(default)s)")
    p.add_argument("--warmup", type=positive_int, default=30,
                   help="calls of the untimed first loop (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed loops; the median is reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--next-matmul", type=int, default=0, metavar="D",
                   help="also time every row followed by the next layer's multiplication of its "
                        "sum by a [D, D] matrix, and report what the call adds to the "
                        "multiplication alone (the Echo paper's Table 2 method; where the "
                        "update of state_update='separate' runs beside it). 0: off (default)")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help=f"run sizes above the memory estimate ({MEMORY_FACTOR} x the message "
                        "per rank) too")
    if gate:
        p.set_defaults(gate=True)
    else:
        p.add_argument("--gate", action="store_true",
                       help="also derive the size-gate threshold (EchoConfig.min_bytes) from "
                            "the measured sizes")
    p.add_argument("--gate-row", choices=[r for r in ROWS if r != "psum"], default=None,
                   help="the row the recommended gate is for (default: the first measured of "
                        f"{', '.join(GATE_ROWS)})")
    kind = "gate" if gate else "allreduce"
    p.add_argument("--json", metavar="OUT", default=None,
                   help=f"JSON output (default: results/bench_{kind}_<machine>.json)")
    p.add_argument("--png", metavar="OUT", default=None,
                   help=f"plot (default: results/bench_{kind}_<machine>.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")


#: What `python -m echo_jax_tools.bench e2e` prints: the end-to-end benchmark is the models'.
E2E_MOVED = ("python -m echo_jax_tools.bench e2e: the end-to-end benchmark is "
             "`python -m models.bench_e2e` (same flags)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m echo_jax_tools.bench`."""
    parser = argparse.ArgumentParser(prog="python -m echo_jax_tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("allreduce", help="all-reduce latency of every row against psum",
                       description="All-reduce latency and correctness of psum, the xla and p2p "
                                   "transports at 8 and 4 bits and the compensated 4-bit call "
                                   "(unfused, fused), per message size; table, JSON and PNG.")
    _add_allreduce_args(p, gate=False)
    p = sub.add_parser("gate", help="derive the size-gate threshold EchoConfig.min_bytes",
                       description="The allreduce benchmark on the small-message sweep, and "
                                   "the smallest size from which Echo is never slower than psum "
                                   "(EchoConfig.min_bytes: smaller messages go to psum).")
    _add_allreduce_args(p, gate=True)
    for name, default in (("kernels", "64MB,256MB"), ("virtual", "16MB,256MB")):
        p = sub.add_parser(name, help="quantizer kernels on one GPU" if name == "kernels" else
                           "older virtual-rank table on one GPU (see allreduce --virtual)")
        p.add_argument("--sizes", type=_sizes_arg, default=parse_sizes(default),
                       help="message sizes per rank, e.g. 64MB,1GB")
        p.add_argument("--iters", type=positive_int, default=30)
        p.add_argument("--repeats", type=positive_int, default=5)
        p.add_argument("--json", help="write the results to this file")
        if name == "kernels":
            p.add_argument("--calls-per-iteration", type=positive_int, default=8,
                           help="calls of each op per iteration of the timed loop, on different "
                                "inputs (the loop's own cost per iteration is shared by them)")
        if name == "virtual":
            p.add_argument("--ranks", type=positive_int, default=4)
    p = sub.add_parser("project", help="projected all-reduce time on a P-GPU NVLink machine",
                       description="Projected time of one all-reduce (psum, xla4, p2p4, p2p8, "
                                   "comp-fused, comp-separate) on a P-GPU NVLink machine from a "
                                   "stated link "
                                   "model and the measured single-GPU times: a projection, not "
                                   "a measurement. Formulas: echo_jax_tools/projection.py.")
    projection.add_arguments(p)
    return parser


def main(argv=None) -> int:
    """Run one benchmark command.

    Args:
      argv: command-line arguments without the program name (default: sys.argv[1:]).

    Returns:
      The exit status (0 on success, 2 on a usage or configuration error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "e2e":
        print(E2E_MOVED, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.cmd == "gate" and args.rows is None:
        args.rows = [r for r in ROWS if r == "psum" or r in GATE_ROWS]
    if args.cmd in ("allreduce", "gate"):
        request_host_devices(args.ranks or 8, minimum=8)
    try:
        if args.cmd in ("allreduce", "gate"):
            result = bench_allreduce(args)
            result = {**provenance.record(provenance.command(PROGRAM, argv), result["device"]),
                      **result}
            if args.gate:
                result["gate"] = gate_summary(result, args.gate_row)
            print(format_allreduce_table(result))
            stem = f"results/bench_{args.cmd}_{result['machine']}"
            out = args.json or f"{stem}.json"
            write_json(out, result)
            print(f"wrote {out}")
            if not args.no_plot and result["rows"]:
                png = args.png or f"{stem}.png"
                plot_allreduce(result, png)
                print(f"wrote {png}")
            return 0
        if args.cmd == "project":
            projection.run(args)
            return 0
    except ValueError as err:
        print(f"python -m echo_jax_tools.bench {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    result = bench_kernels(args) if args.cmd == "kernels" else bench_virtual(args)
    result = {**provenance.record(provenance.command(PROGRAM, argv), result["device"]),
              **result}
    for row in result["rows"]:
        print(json.dumps(row))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
