"""``python -m models.experiments inference``: the Echo paper Tables 4-6 analog.

Perplexity of a checkpoint under 16-bit, 8-bit comp / none, 4-bit comp / none, 4-bit sym, 4-bit
naive asym and early-site 8-bit all-reduces at every forward site, with the greedy next-token
agreement with the 16-bit run. -> ``results/accuracy_inference_<model>.json|png``.
"""

from __future__ import annotations

from pathlib import Path

from models.cli import write_json
from models.config import CommConfig
from models.experiments.helpers import (Scorer, Variant, announce, describe_comm, echo_config,
                                        format_rows, load_setup, log_line, progress_bar,
                                        provenance, utc_now)
from models.experiments.plots import plot_inference


def inference_variants(tp: int, transport: str = "xla", extra: bool = False) -> list:
    """The rows of the inference table (Tables 4-6 analog), 16-bit first.

    Args:
      tp: the number of ranks P.
      transport: the Echo transport ("xla" under the vmap simulation).
      extra: also the rows that run only when named by --configs (`EXTRA_INFERENCE`).

    Returns:
      A list of `Variant`.
    """

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
        Variant("4bit-comp-int8state", "4-bit", "4-bit comp, int8 state (scale per 128)",
                c(4, state_dtype="int8")),
        Variant("4bit-comp-separate", "4-bit", "4-bit comp, update as its own op",
                c(4, state_update="separate")),
        Variant("4bit-comp-local", "4-bit", "4-bit comp, local residual",
                c(4, residual="local")),
        Variant("4bit-comp-int8state-local", "4-bit",
                "4-bit comp, int8 state (scale per 128), local residual",
                c(4, state_dtype="int8", residual="local")),
        Variant("4bit-comp-int4state-local", "4-bit",
                "4-bit comp, int4 state (scale per 128), local residual",
                c(4, state_dtype="int4", residual="local")),
    ] if extra else [])


#: Rows of the inference table that run only when --configs names them.
EXTRA_INFERENCE = ("4bit-comp-bf16state", "4bit-comp-int8state", "4bit-comp-separate",
                   "4bit-comp-local", "4bit-comp-int8state-local", "4bit-comp-int4state-local")


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
    announce(setup, len(variants))
    rows = []
    bar = progress_bar(variants, desc="configs", unit="config", disable=args.quiet, leave=False)
    for v in bar:
        nums = scorer.score(v.comm, v.label)
        rows.append({"config": v.key, "label": v.label, "group": v.group,
                     **describe_comm(v.comm), **nums})
        log_line(args, f"{v.label:<48} ppl {nums['perplexity']:10.4f}  agreement "
                   f"{nums.get('greedy_agreement', float('nan')):.4f}")
    record = {**provenance(args, setup),
              "experiment": "inference", "paper": "the Echo paper Tables 4-6 (Sec. 7.2)",
              "created": utc_now(), "meta": setup.meta,
              "note": args.note, "rows": rows}
    out = Path(args.out_dir) / f"accuracy_inference_{setup.name}.json"
    write_json(out, record)
    png = out.with_suffix(".png")
    plot_inference(record, png)
    print(format_rows(rows, ("label", "perplexity", "delta_ppl_vs_16bit", "greedy_agreement",
                             "next_token_accuracy", "wire_bits_per_element")))
    print(f"wrote {out} and {png}")
    return record
