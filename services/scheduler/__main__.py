"""`python -m services.scheduler [--flags]` serves; `... audit RUN_DIR` checks a run's ledger;
`... status [--address HOST:PORT | --run-dir DIR] [--watch]` shows a running one (status_view.py)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["audit"]:
        from services.scheduler.ledger.audit import main as audit

        sys.exit(audit(sys.argv[2:]))
    if sys.argv[1:2] == ["status"]:
        from services.scheduler.observe.status_view import main as status

        sys.exit(status(sys.argv[2:]))
    from services.scheduler.server import main

    main()
