"""Shared pieces of the accuracy studies (models.experiments).

The paper's default configs and the `Variant` rows, the `Setup` every model study starts from
(checkpoint, text, windows, runner: `load_setup`), the `Scorer` (``models.eval.score_windows``:
the model's own forward pass) and the output helpers (tables, log lines, the recorded command).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import numpy as np

from echo_jax.config import EchoConfig
from models import eval as E
from models import model as M
from models.checkpoints import load_checkpoint_spec
from models.cli import make_mesh, place, run_provenance
from models.cli import recorded_command as cli_command
from models.config import CommConfig, check_tp, config_label, supported_tp
from models.data import select_windows, text_stream

RESULTS_DIR = "results"
DEFAULT_WINDOW = 512

#: Paper defaults of the compensator (the Echo paper Sec. 7.4); every ablation changes one thing.
DEFAULTS = {"eta": 0.75, "blend": 0.35, "beta1": 0.7, "beta2": 0.3}

#: The goal of `beyond` (its table and plot): <= 4.5 wire bits per element ...
BEYOND_BUDGET = 4.5
BEYOND_TARGET_PCT = 10.0    # ... within +10 % perplexity of 16-bit
BEYOND_8BIT_PCT = 0.2       # and 8-bit within +0.2 %


def progress_bar(iterable=None, **kw):
    """A tqdm bar when tqdm is installed, else the plain iterable (the bar is a convenience)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of models.eval
        return iterable if iterable is not None else _NoBar()
    return tqdm(iterable, dynamic_ncols=True, **kw)


class _NoBar:
    """The progress-bar methods the studies call, doing nothing (no tqdm)."""

    def update(self, *_):
        pass

    def set_postfix_str(self, *_):
        pass

    def close(self):
        pass


def utc_now() -> str:
    """The current UTC time as an ISO 8601 string (the "created" field of every record)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def echo_config(bits: int, transport: str = "xla", **changes):
    """The paper's default EchoConfig at `bits` (g = 128, zero-aware asym, eta 0.75, a 0.35,
    beta 0.7 / 0.3) with some fields changed."""
    return EchoConfig(bits=bits, transport=transport, **changes)


class Variant(NamedTuple):
    """One row of a sweep: a short key, a group, a readable label and the CommConfig."""

    key: str
    group: str
    label: str
    comm: object


def describe_comm(comm) -> dict:
    """The JSON fields of a CommConfig: bits, policy, g, compensator coefficients, early 8-bit
    (a site policy: bits None and the policy's configs and tables)."""
    if comm.site_policy is not None:
        sp = comm.site_policy
        cfgs = [c for c in sp.configs if c is not None]
        return {"bits": None, "policy": None, "group_size": None,
                "compensated": any(c.compensated for c in cfgs) and comm.compensate_forward,
                "eta": None, "blend": None, "beta1": None, "beta2": None, "early_8bit": False,
                "tp": comm.tp, "site_policy": {"name": sp.name, "configs": [
                    config_label(c) for c in sp.configs], "forward": [list(r) for r in
                                                                      sp.forward]}}
    if comm.echo is None:
        return {"bits": 16, "policy": None, "group_size": None, "compensated": False,
                "eta": None, "blend": None, "beta1": None, "beta2": None, "early_8bit": False,
                "tp": comm.tp}
    e = comm.echo
    return {"bits": e.bits, "policy": e.policy, "group_size": e.group_size,
            "compensated": e.compensated, "eta": e.eta, "blend": e.blend, "beta1": e.beta1,
            "beta2": e.beta2, "early_8bit": comm.early_8bit, "tp": comm.tp,
            "transport": e.transport, "rotation": getattr(e, "rotation", "none"),
            "state_dtype": e.state_dtype, "state_update": e.state_update,
            "residual": e.residual}


def exact_comm(tp: int):
    """The exact 16-bit CommConfig (lax.psum) at P = `tp`: the reference row of every table."""
    return CommConfig(tp=tp)


class Setup(NamedTuple):
    """What every evaluation sub-command needs: the model, its text, the windows, the runner."""

    name: str            # model tag used in file names
    model_cfg: object
    params_full: dict    # host numpy, unsharded
    windows: np.ndarray  # int32 [N, window + 1]
    tp: int
    mesh: object         # a Mesh, or None (vmap simulation)
    mode: str            # how the ranks run, in words
    meta: dict           # JSON description: checkpoint, text, windows, P, ...
    tokenizer: object = None  # None: UTF-8 bytes (random weights)


def _model_tag(spec: str) -> str:
    if spec.startswith("random:"):
        return "random-" + spec.split(":", 1)[1]
    p = Path(spec)
    name = p.stem if p.suffix == ".gguf" else p.name
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name) or "model"


def default_tp(model_cfg) -> int:
    """P = 4 where the model splits 4 ways (the paper's P), else 3 (SmolLM2's 9 / 3 heads), else
    the largest supported P <= 4."""
    ok = supported_tp(model_cfg, 8)
    for p in (4, 3):
        if p in ok:
            return p
    return max(p for p in ok if p <= 4)


def load_setup(args) -> Setup:
    """Load the checkpoint and the text, choose the windows and the runner.

    Args:
      args: parsed common flags (see `add_common_args`).

    Returns:
      A `Setup`.
    """
    spec = args.checkpoint
    cfg, params, tokenizer, info = load_checkpoint_spec(spec, args.dtype, args.tokenizer,
                                                        args.cache_dir, args.seed)
    tp = args.tp if args.tp is not None else default_tp(cfg)
    check_tp(cfg, tp)
    if args.window > cfg.max_seq_len:
        raise ValueError(f"--window {args.window} exceeds the model's max_seq_len "
                         f"{cfg.max_seq_len}")

    tokens, source = text_stream(tokenizer, args.text, "heldout", args.cache_dir,
                                 getattr(args, "shakespeare_dir", None), progress=not args.quiet)
    count = args.windows
    if args.max_tokens is not None:
        if args.max_tokens < args.window:
            raise ValueError(f"--max-tokens {args.max_tokens} is below one --window "
                             f"{args.window}")
        by_tokens = args.max_tokens // args.window
        count = by_tokens if count is None else min(count, by_tokens)
    try:
        windows = select_windows(tokens, args.window, count, args.contiguous)
    except ValueError as err:
        raise ValueError(f"{len(tokens)} tokens hold no window of {args.window} + 1 ({err}); "
                         "use a smaller --window") from None

    mesh, mode = make_mesh(CommConfig(tp=tp), args.simulate)
    meta = {
        **info, "model": dataclasses.asdict(cfg), "num_params": cfg.num_params(), "tp": tp,
        "forward_sites": 2 * cfg.n_layers, "mode": mode, "text": source,
        "text_tokens": int(len(tokens)), "window": args.window, "windows": int(len(windows)),
        "tokens_scored": int(windows.shape[0] * args.window),
        "window_selection": "first" if args.contiguous else "spread evenly over the text",
        "batch_size": args.batch_size, "device": str(jax.devices()[0].device_kind),
    }
    return Setup(args.name or _model_tag(spec), cfg, params, windows, tp, mesh, mode, meta,
                 tokenizer)


class Scorer:
    """Scores the windows of a `Setup` under any CommConfig; remembers the 16-bit argmax.

    Args:
      setup: the `Setup`.
      batch_size: windows per forward pass.
      progress: show per-configuration progress bars.
    """

    def __init__(self, setup: Setup, batch_size: int, progress: bool):
        self.setup = setup
        self.batch_size = max(1, min(batch_size, len(setup.windows)))
        self.progress = progress
        self.params = place(M.shard_params(setup.params_full, setup.tp, setup.model_cfg),
                            setup.mesh, CommConfig(tp=setup.tp))
        self.reference = None   # (perplexity, argmax [N, W]) of the 16-bit run

    def score(self, comm, desc: str) -> dict:
        """Perplexity and friends of one configuration.

        Args:
          comm: the CommConfig.
          desc: the progress bar's label.

        Returns:
          {"perplexity", "nll", "tokens", "next_token_accuracy", "wire_bits_per_element",
          "seconds"} and, once a 16-bit run was scored, "greedy_agreement" (fraction of
          positions whose argmax equals the 16-bit run's) and "delta_ppl_vs_16bit".
        """
        s = self.setup
        wins = list(s.windows)
        t0 = time.perf_counter()
        nll_sum, count, top = E.score_windows(self.params, wins, s.model_cfg, comm, s.mesh,
                                              self.batch_size, progress=self.progress,
                                              desc=desc)
        seconds = time.perf_counter() - t0
        nll = nll_sum / count
        ppl = math.exp(nll)
        targets = s.windows[:, 1:]
        out = {"perplexity": ppl, "nll": nll, "tokens": int(count),
               "next_token_accuracy": float(np.mean(top == targets)),
               "wire_bits_per_element": E.wire_bits_per_element(
                   s.model_cfg, comm, self.batch_size * targets.shape[1]),
               "seconds": round(seconds, 2)}
        if comm.exact and self.reference is None:
            self.reference = (ppl, top)
        if self.reference is not None:
            ref_ppl, ref_top = self.reference
            out["greedy_agreement"] = float(np.mean(top == ref_top))
            out["delta_ppl_vs_16bit"] = ppl - ref_ppl
            out["rel_delta_ppl_vs_16bit_pct"] = 100.0 * (ppl - ref_ppl) / ref_ppl
        return out

    def ensure_reference(self) -> dict:
        """Score the 16-bit run (once) and return its row numbers."""
        return self.score(CommConfig(tp=self.setup.tp), f"P={self.setup.tp} 16-bit")


def format_rows(rows: Sequence[dict], keys: Sequence[str]) -> str:
    """A plain-text table of some keys of the rows (floats with 4 decimals)."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 1e4 and (v == 0 or abs(v) >= 1e-3) else f"{v:.3e}"
        return "-" if v is None else str(v)

    table = [list(keys)] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def announce(setup: Setup, n: int) -> None:
    """Print what a study runs: the model, P, the runner, the windows and `n` configurations."""
    m = setup.meta
    print(f"model: {m['model']['name']} ({setup.model_cfg.num_params() / 1e6:.1f}M params, "
          f"{m['forward_sites']} forward sites); P={setup.tp}; {setup.mode}; {m['windows']} "
          f"windows of {m['window']} tokens ({m['tokens_scored']} scored); {n} configurations")


def log_line(args, line: str) -> None:
    """Print one progress line unless --quiet."""
    if not args.quiet:
        print(line, flush=True)


def recorded_command(args) -> str:
    """The command line of this run as stored in its JSON record (local folders as DIR)."""
    return cli_command("models.experiments", args.argv)


def provenance(args, setup: Setup) -> dict:
    """{"command", "commit", "device"} of this run, the first keys of its JSON records
    (`models.cli.run_provenance`; the device(s) of the setup's runner)."""
    return run_provenance(recorded_command(args), setup.mesh)
