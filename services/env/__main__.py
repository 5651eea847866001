"""`python -m services.env`: run the Environment service, or `... check ENV_SPEC` (see server.py)."""

from services.env.server import main

if __name__ == "__main__":
    main()
