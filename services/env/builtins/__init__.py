"""Built-in environments: arithmetic (default), gsm8k, reasoning_gym:<task>, and the multi-turn
tool_arithmetic (a calculator tool) and guessing (feedback turns)."""
