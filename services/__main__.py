"""`python -m services <cmd> [options]`: the `grpo-mesh` command line (services/cli.py) where the
console script is not installed, e.g. in the Docker image (`python -m services prepare ...`)."""

import sys

from services.cli import main

if __name__ == "__main__":
    sys.exit(main())
