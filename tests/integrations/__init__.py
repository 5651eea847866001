"""Tests of the ecosystem integrations (atropos, verifiers, OpenEnv)."""
