"""``python -m models.experiments beyond``: accuracy beyond the paper at about 4-bit wire cost.

Perplexity against wire bits per element of uniform configs (8 / 4 bits, g = 128 / 64 / 32, sym,
Hadamard rotation), the early-site 8-bit policy and per-site policies calibrated inside the run
(``models.calibrate``, on training-split text) under wire budgets; a Pareto table and plot.
``--resume`` continues a run cut off by a time limit. -> ``results/accuracy_beyond[_<name>]
.json|png`` and the calibrated ``policy_beyond[_<name>]_b<budget>[-h].json`` files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Sequence

from echo_jax.config import EchoConfig
from models import calibrate as K
from models.calibrate import parse_option
from models.cli import write_json
from models.config import CommConfig, load_site_policy
from models.data import select_windows, text_stream
from models.experiments.helpers import (BEYOND_8BIT_PCT, BEYOND_BUDGET, BEYOND_TARGET_PCT, Scorer,
                                        Setup, announce, describe_comm, echo_config, format_rows,
                                        load_setup, log_line, provenance, utc_now)
from models.experiments.plots import plot_beyond

#: The default rows of `beyond` (16-bit always runs first, as the reference). A key is either an
#: option of `models.calibrate.parse_option` run at every site ("4g64", "4g64-sym-h", ...),
#: "early-8bit", or "calib-<budget>[-h][-proxy|-measure]": a policy calibrated inside the run on
#: training-split text under that budget, with the --calib-options (with "-h": all of them
#: Hadamard-rotated), by --calib-method or the method the suffix names.
BEYOND_DEFAULT = ("16bit", "8g128", "8g128-h", "4g128", "4g64", "4g32", "4g128-sym", "4g64-sym",
                  "4g128-h", "4g64-h", "4g64-sym-h", "early-8bit", "calib-4.5", "calib-5.0",
                  "calib-4.5-h", "calib-5.0-h", "calib-4.5-proxy", "calib-4.5-h-proxy")

_CALIB_KEY = re.compile(r"^calib-(?P<budget>\d+(?:\.\d+)?)(?P<h>-h)?(?:-(?P<m>proxy|measure))?$")


def _rotation_supported() -> bool:
    return "rotation" in {f.name for f in dataclasses.fields(EchoConfig)}


def beyond_row_spec(key: str) -> dict:
    """What a `beyond` key means: {"kind": "exact" | "uniform" | "early" | "calib", ...}."""
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
                        extra={**provenance(args, setup),
                               "calibration": K.compact_calibration(rec, spec["budget"],
                                                                   settings)})
            summary = K.summarize_choice(policy, setup.model_cfg.n_layers)
            extra = {"calibration": {"method": stats["method"], "budget_bits": spec["budget"],
                                     "options": list(rec["options"]),
                                     "policy_file": str(path), "chosen": summary,
                                     "measure_seconds": round(measured_s, 2),
                                     "seconds": round(time.perf_counter() - t0, 2), **text}}
            log_line(args, f"calibrated ({stats['method']}, budget {spec['budget']:g}): {summary}")
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
    announce(setup, len(keys) + len(policies))
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
        log_line(args, f"{label:<60} {row['wire_bits_per_element']:6.3f} bits  ppl "
                   f"{nums['perplexity']:10.4f}  ({nums.get('rel_delta_ppl_vs_16bit_pct', 0):+.3f}"
                   f" %)  {nums['seconds']:.1f} s")
        record = _beyond_record(args, setup, rows, skipped)
        write_json(out, record)              # after every row: a cut-off run keeps its rows
    if record is None:
        record = _beyond_record(args, setup, rows, skipped)
    rows, goal = record["rows"], record["goal"]
    write_json(out, record)
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
    return {**provenance(args, setup),
            "experiment": "beyond", "paper": "beyond the Echo paper: per-site precision "
            "(cf. its early-site policy, Sec. 7.2), group size g (Sec. 4, Table 8) and rotation "
            "at about 4-bit wire cost", "created": utc_now(),
            "meta": {**setup.meta, "wire_bits": "average over the 2 L forward sites of one "
                     "pass of codes plus bf16 scale / fp16 zero-point bits per element (padding "
                     "included; wire_bits_nominal without)",
                     "calibration_text": "the training split (no held-out work) unless "
                                         "--calib-text"},
            "note": args.note, "goal": goal, "pareto": [rows[i]["key"] for i in front],
            "skipped": skipped, "rows": rows}
