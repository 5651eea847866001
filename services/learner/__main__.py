"""`python -m services.learner [--flags]`: run the Learner service (server.py); the same as
`grpo-mesh serve learner`."""

from services.learner.server import main

if __name__ == "__main__":
    main()
