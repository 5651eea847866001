"""Tests of environments from other ecosystems (services/env/integrations/)."""
