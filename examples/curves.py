"""Held-out reward per step and per wall-clock second of each demo run (`--curves PNG`).

Each run's weights after every update are kept in memory (a copy of the state dict: no disk
write inside a timed step), with the run's wall-clock seconds at that update. Once the runs
are over, every kept policy is scored on the held-out set (the same prompts and sampling
seeds as the demo's before/after scores, fewer samples per prompt: `CURVE_N`) and the curves
are drawn: reward against step and against wall-clock seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

CURVE_N = 4  # held-out samples per prompt for each point of a curve (the final scores use more)
LABELS = {"off": "synchronous, SD off", "tlt": "synchronous TLT", "async": "asynchronous TLT"}


@dataclass
class Curve:
    """One run's kept policies: (step, wall-clock seconds since the run's start, weights)."""

    mode: str
    points: list[tuple[int, float, dict[str, torch.Tensor]]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # held-out reward per point

    def keep(self, step: int, seconds: float, model: torch.nn.Module) -> None:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.points.append((step, seconds, weights))


class Curves:
    def __init__(self) -> None:
        self.runs: dict[str, Curve] = {}
        self.initial = 0.0  # the initial policy's held-out reward, at CURVE_N

    def of(self, mode: str) -> Curve:
        return self.runs.setdefault(mode, Curve(mode))

    def score(self, trainer: Any, work_dir: Path, evaluate: Callable[[Path, str], float]) -> None:
        """Score every kept policy: loaded into `trainer`'s model, saved as a checkpoint,
        `evaluate(checkpoint, label)` -> held-out mean reward."""
        for curve in self.runs.values():
            for step, _, weights in curve.points:
                trainer.model.load_state_dict(weights)
                ckpt = trainer.save(work_dir / f"curve-{curve.mode}-{step}")
                curve.scores.append(evaluate(ckpt, f"curve {curve.mode} step {step}"))

    def plot(self, path: Path) -> None:
        """Reward against step and against wall-clock seconds, step 0 the initial policy's."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
        for curve in self.runs.values():
            steps = [0] + [s for s, _, _ in curve.points]
            seconds = [0.0] + [t for _, t, _ in curve.points]
            rewards = [self.initial, *curve.scores]
            label = LABELS.get(curve.mode, curve.mode)
            by_step.plot(steps, rewards, "o-", label=label)
            by_time.plot(seconds, rewards, "o-", label=label)
        by_step.set_xlabel("RL step (updates)")
        by_time.set_xlabel("wall-clock seconds of the run (steps only)")
        for ax in (by_step, by_time):
            ax.set_ylabel(f"held-out reward (n={CURVE_N} per prompt)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def curve_config(cfg: Any) -> Any:
    """The demo's configuration with `CURVE_N` held-out samples per prompt."""
    return replace(cfg, held_out_n=CURVE_N)
