"""Adapters from training libraries to Rewind's checkpoints and supervisor (no Prefect)."""
