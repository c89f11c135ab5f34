"""``python -m models.experiments pretrain-table``: the Echo paper Table 7a analog.

Tail-100 mean loss of each ``python -m models.train --json`` run and its gap to the 16-bit run in
%, plus the overlaid loss curves. -> ``results/accuracy_pretrain.json|png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from models.cli import write_json
from models.experiments.helpers import format_rows, recorded_command, utc_now
from models.train import plot_runs

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
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    rows = pretrain_table(runs, args.labels, args.baseline, args.early_step)
    for row, path in zip(rows, args.runs):
        row["file"] = str(path)
    # Which code and device made the runs (each models.train JSON records its own): the table
    # computes nothing on a device, its "commit" and "device" are the runs'.
    made_by = {k: ", ".join(dict.fromkeys(str(r[k]) for r in runs if r.get(k))) or None
               for k in ("commit", "device")}
    record = {"command": recorded_command(args), **made_by,
              "experiment": "pretrain-table", "paper": "the Echo paper Table 7 (Sec. 7.3)",
              "created": utc_now(), "note": args.note, "tail": TAIL, "rows": rows}
    out = Path(args.out_dir) / (f"accuracy_pretrain{'_' + args.tag if args.tag else ''}.json")
    write_json(out, record)
    png = out.with_suffix(".png")
    base = next(i for i, r in enumerate(rows) if r["baseline"])
    order = [base] + [i for i in range(len(runs)) if i != base]  # the plot's diffs use run 0
    plot_runs([runs[i] for i in order], str(png), [rows[i]["label"] for i in order],
              smooth=args.smooth, title=args.title or "pretraining loss (Table 7a analog)")
    print(format_rows(rows, ("label", "bits", "compensated", "peak_lr", "steps",
                             "tail100_mean_loss", "gap_vs_baseline_pct", "loss_at_early_step")))
    print(f"wrote {out} and {png}")
    return record
