"""End-to-end benchmark of a models preset: ``python -m models.bench_e2e``.

    python -m models.bench_e2e [--preset tiny] [--tp P] [--simulate] [--modes psum,echo4-comp]
                               [--background-load 0,50,75,100] [--json OUT]

Time to first token (prefill of batch x seq from an empty KV cache, plus the argmax of the last
position) and the mean training step (forward, backward, AdamW) of a `models` preset, per
all-reduce mode, optionally under a background copy load; see `bench_e2e`. The all-reduce share
of a mode is measured against the same programs with the tensor-parallel all-reduces replaced by
the identity. Output: a table and ``results/bench_e2e_<machine>.json``.

It lives with the models (not in ``echo_jax_tools.bench``) because neither the library nor its tools
import them.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import threading
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from echo_jax import tp as tp_ops
from echo_jax._cli import positive_int, request_host_devices, write_json
from echo_jax.config import EchoConfig
from echo_jax_tools import provenance
from echo_jax_tools.bench import machine_name
from models import model as M
from models.cli import add_simulate_arg, make_mesh, place, recorded_command
from models.config import CommConfig, check_tp, get_config, supported_tp
from models.train import OptimConfig, make_optimizer


class BackgroundLoad:
    """Copies on a background thread for a fraction `duty` of the time (a context manager).

    With two or more devices every busy slice copies a buffer from each device to the next one
    (a ring of device-to-device copies through the runtime: peer-to-peer copies between GPUs,
    memory copies between CPU fake devices). With one device it runs a jitted elementwise pass
    over a buffer on that device (a read and a write of the buffer per pass), which competes for
    the device and its memory bandwidth, not for a link. The thread is busy for `duty` of each
    `period_s` and sleeps for the rest; the busy fraction it achieved is `measured_duty`.
    """

    def __init__(self, duty: float, devices, nbytes: int, period_s: float = 0.05):
        """Args:
          duty: fraction of the time in [0, 1] (0: no load).
          devices: the devices of the run.
          nbytes: bytes of the buffer per device.
          period_s: length of one busy + idle cycle.
        """
        self.duty, self.devices, self.nbytes, self.period_s = duty, list(devices), nbytes, period_s
        self.measured_duty = 0.0
        self.copies = 0
        self._stop = threading.Event()
        self._thread = None
        self._error = None

    def _copier(self):
        n = max(1, self.nbytes // 4)
        bufs = [jax.device_put(jnp.zeros((n,), jnp.float32), d) for d in self.devices]
        if len(bufs) >= 2:
            targets = self.devices[1:] + self.devices[:1]

            def once():
                nonlocal bufs
                bufs = [jax.device_put(b, d) for b, d in zip(bufs, targets)]
                jax.block_until_ready(bufs)
        else:
            step = jax.jit(lambda b: b + 1.0)

            def once():
                bufs[0] = step(bufs[0])
                bufs[0].block_until_ready()
        once()  # compile / first allocation outside the measured window
        return once

    def _run(self, once):
        busy, start = 0.0, time.perf_counter()
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                while True:  # a busy slice: at least one copy
                    once()
                    self.copies += 1
                    if self._stop.is_set() or (
                            self.duty < 1.0
                            and time.perf_counter() - t0 >= self.duty * self.period_s):
                        break
                busy += time.perf_counter() - t0
                if self.duty < 1.0:
                    # Idle until the busy fraction so far is back at `duty` (corrects slices
                    # that overran and late wake-ups).
                    self._stop.wait(max(0.0, busy / self.duty - (time.perf_counter() - start)))
        except Exception as err:  # noqa: BLE001 - reported by __exit__
            self._error = err
        self.measured_duty = busy / max(time.perf_counter() - start, 1e-9)

    def __enter__(self):
        if self.duty > 0:
            once = self._copier()
            self._thread = threading.Thread(target=self._run, args=(once,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"background load failed: {self._error}") from self._error
        return False


_MODE_RE = re.compile(r"^(psum|echo(4|8)(-comp(-bf16state)?(-separate)?)?)$")


def parse_modes(text: str) -> list:
    """All-reduce modes of `bench e2e`: psum (exact, 16-bit), echo8, echo4, echo4-comp, ...
    (``-comp-bf16state``: compensated with a bfloat16 state, `EchoConfig.state_dtype`; a
    ``-separate`` suffix on a compensated mode: the update as its own op beside the next matrix
    multiplication, `EchoConfig.state_update="separate"`, e.g. echo4-comp-separate).

    Args:
      text: comma list of modes.

    Returns:
      The list of mode names (psum first).
    """
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if not _MODE_RE.match(m):
            raise ValueError(f"bad mode {m!r}: use psum, echo8, echo4, echo8-comp, echo4-comp, "
                             "echo4-comp-bf16state, or a compensated mode with -separate (e.g. "
                             "echo4-comp-separate)")
    if "psum" in modes:
        modes.remove("psum")
    return ["psum"] + modes


#: Mode that times the model with every tensor-parallel all-reduce replaced by the identity.
NO_ALLREDUCE = "no-allreduce"


@contextlib.contextmanager
def _without_allreduce(counter: list):
    """While active, traced tensor-parallel sites (echo_jax.tp) return their input unreduced.

    The compute is unchanged (same shapes and ops), so the time of a model traced under this is
    its time without the all-reduces. `counter` receives one entry per site traced.
    """
    original = tp_ops._reduce

    def identity(x, axis, config, state, rescale):
        counter.append(1)
        return x, state

    tp_ops._reduce = identity
    try:
        yield
    finally:
        tp_ops._reduce = original


def _comm_for(mode: str, tp: int, transport: str):
    if mode == "psum":
        return CommConfig(tp=tp)
    if mode == NO_ALLREDUCE:
        # Its own axis name: the models' compiled-function caches must not mix it with psum's.
        return CommConfig(tp=tp, axis_name="tp_noar")
    m = _MODE_RE.match(mode)
    bits, comp = int(m.group(2)), bool(m.group(3))
    state_dtype = "bfloat16" if m.group(4) else "float32"
    state_update = "separate" if m.group(5) else "in_call"
    return CommConfig(tp=tp, echo=EchoConfig(bits=bits, eta=0.75 if comp else 0.0,
                                             transport=transport, state_dtype=state_dtype,
                                             state_update=state_update))


def default_tp(model_cfg, num_devices: int) -> int:
    """The largest power-of-two P <= the device count that the preset supports (at least 1)."""
    ok = [p for p in supported_tp(model_cfg) if p <= max(1, num_devices) and p & (p - 1) == 0]
    return max(ok) if ok else 1


def bench_e2e(args) -> dict:
    """Time to first token and training step of a models preset, per all-reduce mode and load.

    Modes: psum (the exact 16-bit baseline), echo{4,8}[-comp] (Echo with or without the
    compensator), and, unless args.no_share, "no-allreduce": the same programs with every
    tensor-parallel all-reduce replaced by the identity. The all-reduce share of a mode is
    (T_mode - T_no-allreduce) / T_mode at the same load: the part of the time that the
    all-reduces add to the critical path (the paper's 1 / (1 - share) bound on the speedup of
    a faster all-reduce follows from it). The small exact psums outside the sites (the QK-norm
    gradients and the global gradient norm) stay in every mode.

    Args:
      args: parsed flags: preset, tp (None: `default_tp`), batch, seq, modes, transport,
        simulate, iters, warmup, loads (percent), background_mb, seed, no_share.

    Returns:
      dict with the setup, "timing", "definitions" and one row per (load, mode): ttft_s
      (median), ttft_mean_s, step_s (mean), step_median_s, speedups against psum at the same
      load, allreduce_share_ttft / allreduce_share_step, measured_load_pct, final_loss.
    """
    cfg = get_config(args.preset)
    devices = jax.devices()
    tp = args.tp or default_tp(cfg, len(devices))
    check_tp(cfg, tp)
    seq = args.seq
    if seq > cfg.max_seq_len:
        raise ValueError(f"--seq {seq} exceeds the {args.preset!r} preset's max_seq_len "
                         f"{cfg.max_seq_len}")
    mesh, placement = make_mesh(CommConfig(tp=tp), args.simulate)
    simulated = mesh is None
    used = devices[:1] if simulated else devices[:tp]
    machine = machine_name(devices[0], tp, simulated=simulated)
    modes = list(args.modes) + ([] if args.no_share else [NO_ALLREDUCE])

    rng = np.random.default_rng(args.seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, seq)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, seq)), jnp.int32)
    full = M.init_params(jax.random.key(args.seed), cfg)
    oc = OptimConfig(lr=3e-4, warmup=10, steps=1000)

    runners = {}
    for mode in modes:
        comm = _comm_for(mode, tp, args.transport)
        m = None if simulated else Mesh(np.array(used), (comm.axis_name,))
        stacked = M.shard_params(full, tp, cfg)
        params = place(stacked, m, comm)
        optimizer = make_optimizer(oc)
        opt_state = place(M.init_opt_state(optimizer, stacked), m, comm)
        cache = place(M.init_cache(cfg, comm, args.batch, seq), m, comm)
        step = M.make_train_step(cfg, comm, optimizer, m, clip_norm=oc.clip_norm)
        runners[mode] = dict(comm=comm, mesh=m, params=params, opt_state=opt_state, cache=cache,
                             step=step, loss=None)

    def context(mode, counter):
        r = runners[mode]
        stack = contextlib.ExitStack()
        if r["mesh"] is not None:
            stack.enter_context(jax.set_mesh(r["mesh"]))  # the GPU custom call reads it
        if mode == NO_ALLREDUCE:
            stack.enter_context(_without_allreduce(counter))
        return stack

    def ttft(mode):
        r = runners[mode]
        t0 = time.perf_counter()
        logits, _ = M.prefill(r["params"], tokens, r["cache"], cfg, r["comm"], r["mesh"])
        jnp.argmax(logits[:, -1], axis=-1).block_until_ready()
        return time.perf_counter() - t0

    def train_step(mode):
        r = runners[mode]
        t0 = time.perf_counter()
        r["params"], r["opt_state"], loss, _ = r["step"](r["params"], r["opt_state"], tokens,
                                                        targets)
        loss.block_until_ready()
        r["loss"] = float(loss)
        return time.perf_counter() - t0

    # Compile every program before any load runs.
    sites = []
    for mode in modes:
        with context(mode, sites):
            ttft(mode)
            train_step(mode)
    if NO_ALLREDUCE in modes and not sites:
        raise RuntimeError("no tensor-parallel site was replaced in the no-allreduce mode "
                           "(echo_jax.tp._reduce was not called); rerun with --no-share")

    rows = []
    for load in args.loads:
        tt = {mode: [] for mode in modes}
        st = {mode: [] for mode in modes}
        with BackgroundLoad(load / 100.0, used, args.background_mb << 20) as bg:
            # Round robin over the modes, so a drift of the machine or of the load does not
            # favour the mode that happens to run first.
            for i in range(args.warmup + args.iters):
                for mode in modes:
                    with context(mode, []):
                        t = ttft(mode)
                    if i >= args.warmup:
                        tt[mode].append(t)
            for i in range(args.warmup + args.iters):
                for mode in modes:
                    with context(mode, []):
                        t = train_step(mode)
                    if i >= args.warmup:
                        st[mode].append(t)
        for mode in modes:
            comm = runners[mode]["comm"]
            rows.append(dict(
                mode=mode, load_pct=load, bits=16 if comm.echo is None else comm.echo.bits,
                compensated=bool(comm.echo is not None and comm.echo.compensated),
                state_dtype=comm.state_dtype,
                ttft_s=statistics.median(tt[mode]), ttft_mean_s=statistics.fmean(tt[mode]),
                step_s=statistics.fmean(st[mode]), step_median_s=statistics.median(st[mode]),
                final_loss=runners[mode]["loss"]))
        for r in rows:
            if r["load_pct"] == load:
                r["measured_load_pct"] = 100.0 * bg.measured_duty
                r["background_copies"] = bg.copies
    for load in args.loads:
        here = {r["mode"]: r for r in rows if r["load_pct"] == load}
        base, none = here["psum"], here.get(NO_ALLREDUCE)
        for r in here.values():
            r["speedup_ttft_vs_psum"] = base["ttft_s"] / r["ttft_s"]
            r["speedup_step_vs_psum"] = base["step_s"] / r["step_s"]
            if none is not None and r["mode"] != NO_ALLREDUCE:
                r["allreduce_share_ttft"] = (r["ttft_s"] - none["ttft_s"]) / r["ttft_s"]
                r["allreduce_share_step"] = (r["step_s"] - none["step_s"]) / r["step_s"]
    msg = args.batch * seq * cfg.dim * jnp.dtype(cfg.dtype).itemsize
    load_what = ("ring of device-to-device copies between the ranks' devices" if len(used) >= 2
                 else "jitted elementwise pass over a buffer on the one device (competes for "
                      "the device, not for a link)")
    return dict(
        benchmark="e2e", machine=machine, device=provenance.device_name(used),
        platform=devices[0].platform, preset=args.preset, params=cfg.num_params(),
        n_layers=cfg.n_layers, dim=cfg.dim, compute_dtype=cfg.dtype, tp=tp, batch=args.batch,
        seq=seq, placement=placement, transport=args.transport,
        allreduce_calls=dict(prefill=2 * cfg.n_layers, train_step=4 * cfg.n_layers,
                             message_bytes_per_rank=int(msg)),
        timing=(f"host wall clock per call with block_until_ready (dispatch included, as a user "
                f"sees it); the modes take turns call by call; {args.warmup} untimed calls per "
                f"mode and load first (compilation happens before any load); ttft_s = median of "
                f"{args.iters} prefills of {args.batch}x{seq} tokens from an empty KV cache plus "
                f"the argmax of the last position; step_s = mean of {args.iters} training steps "
                "(forward, backward, global-norm clipping, AdamW) on one fixed random batch"),
        definitions=dict(
            allreduce_share="(T_mode - T_no-allreduce) / T_mode at the same load, where "
                            "no-allreduce runs the same programs with every tensor-parallel "
                            "all-reduce site (echo_jax.tp) replaced by the identity; may be "
                            "slightly negative from noise when the all-reduces cost ~nothing",
            speedup="T_psum / T_mode at the same load",
            background_load=f"{load_what}, {args.background_mb} MiB per device, busy for the "
                            "given duty cycle (busy slices of duty x 50 ms, idle until the busy "
                            "fraction is back at the duty cycle) on a Python thread; "
                            "measured_load_pct is the busy fraction it achieved"),
        rows=rows)


def format_e2e_table(result: dict) -> str:
    """The e2e rows as a text table."""
    head = ("load", "mode", "TTFT", "x psum", "AR share", "step", "x psum", "AR share")
    widths = (5, 13, 11, 7, 8, 11, 7, 8)
    lines = [f"e2e on {result['machine']} ({result['device']}): {result['preset']}, "
             f"P={result['tp']}, batch {result['batch']} x seq {result['seq']}; "
             f"{result['placement']}",
             "  ".join(h.rjust(w) if i != 1 else h.ljust(w)
                       for i, (h, w) in enumerate(zip(head, widths))),
             "  ".join("-" * w for w in widths)]

    def t(s):
        return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"

    def share(v):
        return "" if v is None else f"{100 * v:.1f}%"

    for r in result["rows"]:
        cells = (f"{r['load_pct']:g}%", r["mode"], t(r["ttft_s"]),
                 f"{r['speedup_ttft_vs_psum']:.2f}", share(r.get("allreduce_share_ttft")),
                 t(r["step_s"]), f"{r['speedup_step_vs_psum']:.2f}",
                 share(r.get("allreduce_share_step")))
        lines.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def _modes_arg(text: str) -> list:
    try:
        return parse_modes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _loads_arg(text: str) -> list:
    try:
        loads = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percentages such as 0,50,100, got "
                                         f"{text!r}") from None
    if not loads or any(not 0 <= v <= 100 for v in loads):
        raise argparse.ArgumentTypeError(f"duty cycles must be in [0, 100], got {text!r}")
    return loads


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m models.bench_e2e`."""
    p = argparse.ArgumentParser(
        prog="python -m models.bench_e2e",
        description=bench_e2e.__doc__.split("\n\n")[0] + ". " +
                       "The all-reduce share is measured against the same programs with the "
                       "tensor-parallel all-reduces replaced by the identity.")
    p.add_argument("--preset", default="tiny", help="models preset (default: %(default)s)")
    p.add_argument("--tp", type=positive_int, default=None, metavar="P",
                   help="tensor-parallel ranks (default: the largest power of two the preset "
                        "supports within the local devices)")
    add_simulate_arg(p)
    p.add_argument("--batch", type=positive_int, default=8, help="batch (default: %(default)s)")
    p.add_argument("--seq", type=positive_int, default=64,
                   help="sequence length of the prefill and of the training batch (default: "
                        "%(default)s)")
    p.add_argument("--modes", type=_modes_arg, default=parse_modes("psum,echo4-comp"),
                   help="all-reduce modes: psum (exact 16-bit), echo8, echo4, echo8-comp, "
                        "echo4-comp, echo4-comp-bf16state (a bfloat16 compensator state), a "
                        "compensated mode with -separate (the update beside the next matmul) "
                        "(default: psum,echo4-comp)")
    p.add_argument("--transport", choices=("auto", "p2p", "xla"), default="auto",
                   help="Echo transport (default: %(default)s)")
    p.add_argument("--background-load", dest="loads", type=_loads_arg, default=[0.0],
                   metavar="PCTS", help="duty cycles of the background copy load in percent, "
                                        "e.g. 0,50,75,100 (default: 0)")
    p.add_argument("--background-mb", type=positive_int, default=16,
                   help="MiB per device of the background copies (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=10,
                   help="timed calls per mode and load (default: %(default)s)")
    p.add_argument("--warmup", type=positive_int, default=3,
                   help="untimed calls per mode and load (default: %(default)s)")
    p.add_argument("--no-share", action="store_true",
                   help="skip the no-allreduce runs (no all-reduce share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", default=None,
                   help="JSON output (default: results/bench_e2e_<machine>.json)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the end-to-end benchmark.

    Args:
      argv: command-line arguments without the program name (default: sys.argv[1:]).

    Returns:
      The exit status (0 on success, 2 on a usage or configuration error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    request_host_devices(args.tp or 8)
    try:
        result = bench_e2e(args)
    except ValueError as err:
        print(f"python -m models.bench_e2e: error: {err}", file=sys.stderr)
        return 2
    result = {**provenance.record(recorded_command("models.bench_e2e", argv), result["device"]),
              **result}
    print(format_e2e_table(result))
    out = args.json or f"results/bench_e2e_{result['machine']}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
