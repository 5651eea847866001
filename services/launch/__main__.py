"""Launchers: `python -m services.launch demo [options]` runs the embedded default end to end;
`python -m services.launch prepare --config RUN_CONFIG` is a deployment's one-shot set-up step."""

import sys

COMMANDS = ("demo", "prepare")

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit("usage: python -m services.launch {demo,prepare} [--help | options]")
    if sys.argv[1] == "demo":
        from services.launch.demo import main
    else:
        from services.launch.prepare import main
    sys.exit(main(sys.argv[2:]))
