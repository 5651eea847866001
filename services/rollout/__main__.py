"""`python -m services.rollout [--flags]`: run a rollout worker (server.py; = `grpo-mesh serve rollout`).
The main guard matters: vLLM spawns its engine-core process, which re-imports this module."""

from services.rollout.server import main

if __name__ == "__main__":
    main()
