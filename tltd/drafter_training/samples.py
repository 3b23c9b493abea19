"""What a job's drafter trains and is measured on: its finished rollout samples, per job.

Token ids only (hidden states are recomputed on the training device with one target prefill,
see workers/drafter/trainer.py). Every `training_held_out_every`-th sample is held out to
measure acceptance at publish time; the others feed the trainer. `recent` refills a new trainer
process (an empty buffer); `unsent` is what the running trainer has not been given yet.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from tltd.contract import drafter_messages as proto
from tltd.settings import Settings


def training_sample(
    prompt: Sequence[int], token_ids: Sequence[int], policy_version: int
) -> proto.TrainingSample | None:
    """A sample as the trainer takes it; None when no drafter position could train on it."""
    if len(token_ids) <= 1:
        return None
    # The rollout "step" of the one-step offset: a policy version is one RL step.
    return proto.TrainingSample(
        (*prompt, *token_ids), len(prompt), policy_version, step=policy_version
    )


class SampleBuffers:
    """Per job: recent, unsent and held-out samples, and how many arrived since the last
    round started (`fresh`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.fresh: Counter[str] = Counter()
        self._seen: Counter[str] = Counter()
        self._recent: dict[str, deque[proto.TrainingSample]] = {}
        self._unsent: dict[str, list[proto.TrainingSample]] = {}
        self._held: dict[str, deque[proto.TrainingSample]] = {}

    def add(self, job_id: str, item: proto.TrainingSample, held_out: bool) -> None:
        """One sample, held out to measure acceptance or kept to train on."""
        cfg = self.settings
        if held_out:
            held = self._held.setdefault(job_id, deque(maxlen=cfg.training_held_out_samples))
            held.append(item)
            return
        n = cfg.training_recent_samples
        self._recent.setdefault(job_id, deque(maxlen=n)).append(item)
        unsent = self._unsent.setdefault(job_id, [])
        unsent.append(item)
        del unsent[:-n]  # bounded like `recent`: a trainer never needs more than that

    def add_finished(self, job_id: str, item: proto.TrainingSample) -> None:
        """A sample finished on this node (one node): every n-th arrival is held out."""
        self._seen[job_id] += 1
        held_out = self._seen[job_id] % self.settings.training_held_out_every == 0
        self.add(job_id, item, held_out)
        if not held_out:
            self.fresh[job_id] += 1

    def clear(self, job_id: str) -> None:
        """Forget the job's samples (a new lease refills them from the store)."""
        for q in (self._recent, self._held, self._unsent):
            q.pop(job_id, None)

    def recent(self, job_id: str) -> tuple[proto.TrainingSample, ...]:
        """What a new trainer process is given; it has them all, so nothing is unsent."""
        self._unsent.pop(job_id, None)
        return tuple(self._recent.get(job_id, ()))

    def buffered(self, job_id: str) -> int:
        """How many samples a trainer of the job holds (or is given when it starts)."""
        return len(self._recent.get(job_id, ()))

    def take_unsent(self, job_id: str) -> list[proto.TrainingSample]:
        return self._unsent.pop(job_id, [])

    def held(self, job_id: str) -> tuple[proto.TrainingSample, ...]:
        return tuple(self._held.get(job_id, ()))
