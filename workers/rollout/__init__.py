"""Rollout worker processes: one per device, running a backend engine behind a typed pipe."""
