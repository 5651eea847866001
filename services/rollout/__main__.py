"""`python -m services.rollout`: run a rollout worker (see server.py). The main guard matters: vLLM
spawns its engine-core process, which re-imports this module."""

from services.rollout.server import main

if __name__ == "__main__":
    main()
