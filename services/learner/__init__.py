"""Learner service: GRPO-family optimizer steps on scored batches and weight publishing."""
