"""Environments from other ecosystems, plugged in unmodified (`openenv.py`: OpenEnv servers)."""
