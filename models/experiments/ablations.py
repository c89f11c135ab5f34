"""``python -m models.experiments ablations``: the Echo paper Table 8 analog.

Each row changes one component of the full method at 4 and 8 bits (quantizer, group size, the
compensator's averages, blend, decays and gain). -> ``results/accuracy_ablations.json|png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from models.cli import write_json
from models.config import CommConfig
from models.experiments.helpers import (Scorer, Variant, announce, describe_comm, echo_config,
                                        exact_comm, format_rows, load_setup, log_line, progress_bar,
                                        provenance, utc_now)
from models.experiments.plots import plot_ablations

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
    out = []
    for key, group, label, changes in ABLATIONS:
        if keys is not None and key not in keys:
            continue
        out.append(Variant(key, group, label,
                           CommConfig(tp=tp, echo=echo_config(bits, transport, **changes))))
    return out


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
    announce(setup, len(plan) + 1)
    ref = scorer.ensure_reference()
    rows = [{"bits": 16, "key": "16bit", "group": "reference", "variant": "16-bit (exact)",
             **describe_comm(exact_comm(setup.tp)), **ref}]
    log_line(args, f"{'16-bit':<58} ppl {ref['perplexity']:10.4f}")
    full = {}
    bar = progress_bar(plan, desc="variants", unit="variant", disable=args.quiet, leave=False)
    for bits, v in bar:
        nums = scorer.score(v.comm, f"{bits}-bit {v.key}")
        row = {"key": v.key, "group": v.group, "variant": v.label, **describe_comm(v.comm),
               **nums}
        if v.key == "full":
            full[bits] = nums["perplexity"]
        rows.append(row)
        log_line(args, f"{bits}-bit {v.label:<52} ppl {nums['perplexity']:10.4f}")
    for row in rows:
        if row["bits"] in full:
            row["delta_ppl_vs_full"] = row["perplexity"] - full[row["bits"]]
    for bits in args.bits:  # the full method's own points of the a and eta sweeps
        src = next((r for r in rows if r["bits"] == bits and r["key"] == "full"), None)
        if src is not None:
            for key, group, label in ABLATION_ALIASES:
                rows.append({**src, "key": key, "group": group, "variant": label + " (= full)",
                             "same_run_as": "full"})
    record = {**provenance(args, setup),
              "experiment": "ablations", "paper": "the Echo paper Table 8 (Sec. 7.4)",
              "created": utc_now(), "meta": setup.meta,
              "note": args.note, "rows": rows}
    out = Path(args.out_dir) / (f"accuracy_ablations{'_' + args.tag if args.tag else ''}.json")
    write_json(out, record)
    png = out.with_suffix(".png")
    plot_ablations(record, png)
    print(format_rows(rows, ("bits", "variant", "perplexity", "delta_ppl_vs_full",
                             "greedy_agreement")))
    print(f"wrote {out} and {png}")
    return record
