"""`python -m services.learner`: run the Learner service (see server.py)."""

from services.learner.server import main

if __name__ == "__main__":
    main()
