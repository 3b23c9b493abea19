"""Drafter training on idle devices (the hook the supervisor calls), its samples, its lease
across nodes and the versions it publishes; `trainers.py` says how a round runs."""

from tltd.drafter_training.runs import Preemption
from tltd.drafter_training.trainers import DrafterTraining

__all__ = ["DrafterTraining", "Preemption"]
