"""OpenAI-compatible HTTP gateway in front of rollout workers (docs/gateway.md)."""
