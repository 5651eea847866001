"""`python -m services.scheduler [--flags]` serves; `... audit RUN_DIR` checks a run's ledger."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["audit"]:
        from services.scheduler.audit import main as audit

        sys.exit(audit(sys.argv[2:]))
    from services.scheduler.server import main

    main()
