"""`python -m services.gateway [--flags]`: run the OpenAI-compatible gateway (server.py)."""

from services.gateway.server import main

if __name__ == "__main__":
    main()
