"""``python -m models.experiments <subcommand>``: see `models.experiments.command_line`."""

import sys

from models.experiments.command_line import main

if __name__ == "__main__":
    sys.exit(main())
