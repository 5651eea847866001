"""The studio: a web page to start, watch and inspect runs and talk to the policy (docs/studio.md)."""
