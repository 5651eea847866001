"""Built-in environments: arithmetic (default), gsm8k, reasoning_gym:<task>."""
