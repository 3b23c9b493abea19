"""Drafter training on idle devices (the hook the supervisor calls), its samples, its lease
across nodes and the versions it publishes; `hook.py` says how a round runs."""

from tltd.drafter_training.hook import DrafterTraining
from tltd.drafter_training.runs import Preemption

__all__ = ["DrafterTraining", "Preemption"]
