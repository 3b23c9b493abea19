"""The task's fixed RL dataset: training prompts iterated in epochs, a validation split that
chooses hyperparameters, and a held-out set that reports results.

RL runs iterate a fixed prompt set (GSM8K, MATH, DAPO-17k) in epochs: every prompt comes back
once per epoch, in a new order. Here the training set is `train_size` prompts of the rollout
workload (workload.py: the prompt-level size tail and alternating care levels), shuffled per
epoch with a seed; step k takes the next `per_step` prompts of that stream. The held-out set is
drawn from another seed, never trained on, and is scored with fixed sampling seeds, so that a
before/after comparison is paired sample by sample. The validation split is drawn from a third
seed, disjoint from both: settings are compared on it (`benchmarks/bench_rl_trend.py`), so the
held-out set that reports a run's result is not the one that picked its settings.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from examples.task.reasoning import Problem
from examples.task.workload import MODEL_DIR, rollout_prompts

TRAIN_SEED = 0
HELD_OUT_SEED = 10**5  # no training set is drawn from it
VALIDATION_SEED = 2 * 10**5  # no training or held-out set is drawn from it
HELD_OUT_SAMPLING_SEED = 4242  # the held-out rollouts' seed, the same before and after
TRAIN_SIZE = 32
HELD_OUT_SIZE = 32
VALIDATION_SIZE = 32

Item = tuple[Problem, list[int]]  # a problem and its prompt token ids (<bos> first)


def _key(problem: Problem) -> tuple[int, int, int]:
    return (problem.start, problem.step, problem.count)


@dataclass
class TaskDataset:
    """`train`, `held_out` and `validation` items; `batch(step)` walks the training set in
    shuffled epochs."""

    train: list[Item]
    held_out: list[Item]
    per_step: int
    shuffle_seed: int = 0
    validation: list[Item] = field(default_factory=list)
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.per_step <= len(self.train):
            raise ValueError(
                f"per_step: must be in [1, {len(self.train)}] (the training set), "
                f"got {self.per_step}"
            )

    def order(self, epoch: int) -> list[int]:
        """The training items' order in `epoch`: a seeded shuffle, different every epoch."""
        if epoch not in self._orders:
            idx = list(range(len(self.train)))
            random.Random(self.shuffle_seed * 1_000_003 + epoch).shuffle(idx)
            self._orders[epoch] = idx
        return self._orders[epoch]

    def epoch_of(self, step: int) -> float:
        """How many epochs the run has covered when step `step` starts (0.5 = half of one)."""
        return step * self.per_step / len(self.train)

    def batch(self, step: int) -> list[Item]:
        """The `per_step` items of RL step `step`: the next ones of the epoch stream (a batch
        that crosses an epoch's end takes the rest from the next epoch's order)."""
        size, out = len(self.train), []
        for pos in range(step * self.per_step, (step + 1) * self.per_step):
            out.append(self.train[self.order(pos // size)[pos % size]])
        return out


def _disjoint(size: int, seed: int, exclude: set[tuple[int, int, int]], model_dir) -> list[Item]:
    """`size` prompts drawn from `seed` with every problem in `exclude` dropped (and made up
    from further draws)."""
    out: list[Item] = []
    extra = 0
    while len(out) < size:
        draw = rollout_prompts(size + extra, seed=seed, model_dir=model_dir)
        out = [item for item in draw if _key(item[0]) not in exclude][:size]
        extra += 1
    return out


def build_dataset(
    per_step: int = 16,
    train_size: int = TRAIN_SIZE,
    held_out_size: int = HELD_OUT_SIZE,
    model_dir: str | Path = MODEL_DIR,
    seed: int = TRAIN_SEED,
    validation_size: int = VALIDATION_SIZE,
) -> TaskDataset:
    """The fixed training set (`train_size` prompts drawn from `seed`), a held-out set from
    HELD_OUT_SEED without the training set's problems, and a validation split from
    VALIDATION_SEED without either's problems: the three are disjoint."""
    train = rollout_prompts(train_size, seed=seed, model_dir=model_dir)
    seen = {_key(p) for p, _ in train}
    held_out = _disjoint(held_out_size, HELD_OUT_SEED, seen, model_dir)
    seen |= {_key(p) for p, _ in held_out}
    validation = _disjoint(validation_size, VALIDATION_SEED, seen, model_dir)
    return TaskDataset(train, held_out, per_step, shuffle_seed=seed, validation=validation)
