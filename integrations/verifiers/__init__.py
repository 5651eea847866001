"""verifiers (0.4.0) environments trained on grpo-mesh. Runs in `.venvs/verifiers`
(scripts/venv_verifiers.sh) and imports only verifiers, httpx and the standard library, never
grpo-mesh's `services`."""
