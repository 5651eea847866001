"""`python -m services.env [--flags]`: run the Environment service (server.py; = `grpo-mesh serve env`).
Checking an environment before training is `grpo-mesh check-env SPEC`."""

from services.env.server import main

if __name__ == "__main__":
    main()
