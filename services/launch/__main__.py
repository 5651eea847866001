"""Launchers: `python -m services.launch demo [options]` runs the embedded default end to end."""

import sys

from services.launch.demo import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        sys.exit("usage: python -m services.launch demo [--help | options]")
    sys.exit(main(sys.argv[2:]))
