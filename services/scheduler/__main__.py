"""`python -m services.scheduler [--flags]`: run the Scheduler service (server.py; = `grpo-mesh serve
scheduler`). A run's status and its ledger audit are `grpo-mesh status` and `grpo-mesh audit RUN_DIR`;
a leading bare word here (`audit`) is refused with a line that says so (services/common/config.py)."""

from services.scheduler.server import main

if __name__ == "__main__":
    main()
