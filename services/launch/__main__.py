"""`python -m services.launch demo|prepare [options]`: the launchers, kept for existing callers; the
same commands as `grpo-mesh demo` and `grpo-mesh prepare` (services/cli.py's one table)."""

import sys

from services.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
