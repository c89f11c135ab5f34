"""`python -m models COMMAND ...`: dispatch to the model CLIs.

    python -m models train --preset tiny --tp 2 --bits 4 --steps 100
    python -m models train plot a.json b.json -o compare.png
    python -m models eval --checkpoint smollm2 --tp 3 --bits 4
    python -m models generate --checkpoint smollm2 --prompt "Once upon a time"
    python -m models calibrate --checkpoint smollm2 --tp 3 --budget-bits 4.5 --out policy.json
    python -m models data --help
    python -m models bench-e2e --preset tiny --tp 2
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "train": ("models.train", "train a preset (or continue a checkpoint); `train plot` overlays runs"),
    "eval": ("models.eval", "perplexity of a checkpoint, exact or Echo, with greedy agreement"),
    "generate": ("models.generate", "continue a prompt with the KV cache"),
    "calibrate": ("models.calibrate", "choose per-site all-reduce configs under a wire budget "
                                      "(--site-bits policy)"),
    "data": ("models.data", "prepare and tokenize the corpus, print its statistics"),
    "bench-e2e": ("models.bench_e2e", "time to first token and training step per all-reduce "
                                      "mode"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the named sub-command with the remaining arguments.

    Args:
      argv: the arguments (default sys.argv[1:]); the first names the command.

    Returns:
      The sub-command's exit status (2 for an unknown command).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
        print("usage: python -m models {" + ",".join(COMMANDS) + "} [--help | ARGS ...]\n\n"
              "commands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
