"""Command line of echo_jax: ``python -m echo_jax COMMAND [options]`` (or ``echo-jax COMMAND``).

Commands:
  demo   toy residual stack: per-site and accumulated all-reduce error per mode (Eq. 5, Eq. 6)
  doctor the platform, the custom-call modules built, and which transport each axis size gets

Each command is a subparser with a handler ``_cmd_<name>(args) -> exit status``; add a command by
adding a ``_add_<name>`` function to `_COMMANDS`. The demo itself is `echo_jax_tools.demo`, which
its handler imports when it runs: no echo_jax module imports the tools at import time. The fake
CPU devices of the demo are requested through XLA_FLAGS (`echo_jax._cli.request_host_devices`),
which XLA reads when its CPU backend starts, not at ``import jax``: the handler sets it before
anything touches a device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from echo_jax._cli import positive_int, request_host_devices, write_json


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


# --------------------------------------------------------------------------------------------
# demo


def _add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="error accumulation of 16/8/4-bit and compensated 4-bit all-reduce on a toy stack",
        description=(
            "Run a scanned toy residual stack of tensor-parallel MLP blocks at P ranks on fake "
            "CPU devices, once per all-reduce mode (16-bit, 8-bit, 4-bit, 4-bit compensated), "
            "and print the per-site error ||rho_k|| (Echo paper Eq. 5), the accumulated error "
            "max_t ||S_t|| (Eq. 6) and the final output error against an exact fp32 run, with "
            "the Theorem 1 reference constant 1 + mu_w."))
    p.add_argument("--ranks", type=positive_int, default=4,
                   help="tensor-parallel ranks P (default: %(default)s)")
    p.add_argument("--sites", type=positive_int, default=56,
                   help="all-reduce sites N per pass (default: %(default)s, Qwen3-0.6B's "
                        "28 layers x 2)")
    p.add_argument("--tokens", type=positive_int, default=64,
                   help="rows of the hidden state (default: %(default)s)")
    p.add_argument("--dim", type=positive_int, default=256,
                   help="width d of the hidden state (default: %(default)s)")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="MLP width h, a multiple of --ranks (default: 4 * dim)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the input (default: %(default)s)")
    p.add_argument("--eta", type=_unit_float, default=0.75,
                   help="gain of the 4-bit comp mode (Eq. 10; default: %(default)s); 1 is "
                        "Theorem 1's case")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="also write {'config': ..., 'rows': [...]} as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_cmd_demo)


def _cmd_demo(args) -> int:
    request_host_devices(args.ranks, minimum=8)
    from echo_jax_tools import demo  # here, not at the top: `import echo_jax` loads no tool

    try:
        result = demo.run_demo(ranks=args.ranks, sites=args.sites, tokens=args.tokens,
                               dim=args.dim, hidden=args.hidden, seed=args.seed, eta=args.eta,
                               progress=not args.no_progress)
    except ValueError as err:
        print(f"{_prog()} demo: error: {err}", file=sys.stderr)
        return 2
    print(demo.format_table(result))
    if args.json:
        write_json(args.json, result, indent=2)
    return 0


# --------------------------------------------------------------------------------------------
# doctor


def _add_doctor(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="what this install runs: the platform, the custom-call modules, the transport of "
             "each axis size and why",
        description=(
            "Print the platform and its local devices, the versions of jax, jaxlib (with its XLA "
            "FFI API) and flax, the custom-call modules built (echo_jax._ffi, "
            "echo_jax._ffi_cuda: the jaxlib headers and XLA FFI API they were compiled against, "
            "the CUDA architectures where the build records them, whether this jaxlib accepts "
            "them), and for each axis size P which transport transport='auto' gives an "
            "echo_psum over one mesh axis of the first P local devices, and why: the reason and "
            "its fix are the text of the EchoFallbackWarning and of the transport='p2p' error. "
            "Exit status 1 where some axis size falls back to 'xla' with that warning."))
    p.add_argument("--axis-size", type=positive_int, nargs="+", default=None, metavar="P",
                   help="the axis sizes to ask about (default: 2 up to the local devices, at "
                        "most 8)")
    p.add_argument("--json", metavar="OUT", nargs="?", const="-", default=None,
                   help="print the findings as JSON instead of text (with a file name: write "
                        "them there too, and print the text)")
    p.set_defaults(handler=_cmd_doctor)


def _cmd_doctor(args) -> int:
    from echo_jax import doctor
    record = doctor.collect(args.axis_size)
    if args.json == "-":
        print(json.dumps(record, indent=1))
    else:
        print(doctor.format_report(record))
        if args.json:
            write_json(args.json, record, indent=1)
    return 1 if record["problems"] else 0


# --------------------------------------------------------------------------------------------
# entry point

_COMMANDS = (_add_demo, _add_doctor)


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m echo_jax" if name in ("", "__main__.py", "-c") else name


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="echo_jax: error-compensated 4-bit tensor-parallel all-reduce for JAX.")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND",
                                required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen command.

    Args:
      argv: command-line arguments without the program name.

    Returns:
      The exit status (0 on success, 2 on a usage or configuration error).
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
