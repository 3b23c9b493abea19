"""Engine statistics: plain vs speculative steps, accepted lengths, time per phase."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.engine.bandit import Strategy


@dataclass
class _SpecTotals:
    """Totals of the SD steps taken with one strategy."""

    steps: int = 0
    rows: int = 0  # sum of batch sizes: sequence-steps
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    seconds: float = 0.0

    def add(self, other: _SpecTotals) -> None:
        self.steps += other.steps
        self.rows += other.rows
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.seconds += other.seconds

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "steps": self.steps,
            "rows": self.rows,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "mean_accepted_length": _ratio(self.emitted, self.rows),
            "acceptance_rate": _ratio(self.accepted, self.drafted),
            "tokens_per_s": _ratio(self.emitted, self.seconds),
        }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _total(value: int | Sequence[int]) -> int:
    return int(value) if isinstance(value, int) else int(sum(value))


@dataclass
class EngineStats:
    """Counters the engine updates once per decode step; `summary()` is what gets reported.

    Accepted length follows the EAGLE/TLT convention: tokens a sequence gains in one SD step
    (accepted draft tokens + the one the target samples itself), so plain decoding is 1.0.
    """

    plain_steps: int = 0
    plain_rows: int = 0
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    spec: dict[str, _SpecTotals] = field(default_factory=dict)
    # emitted tokens per sequence per SD step -> how many times
    accepted_length_hist: Counter[int] = field(default_factory=Counter)
    other_seconds: Counter[str] = field(default_factory=Counter)  # prefill, drafter training...

    def record_plain_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """One ordinary decode step over batch_size sequences producing `tokens` tokens."""
        self.plain_steps += 1
        self.plain_rows += batch_size
        self.plain_tokens += tokens
        self.plain_seconds += seconds

    def record_spec_step(
        self,
        batch_size: int,
        strategy: Strategy | str,
        drafted: int | Sequence[int],
        accepted: int | Sequence[int],
        emitted: int | Sequence[int],
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        """One draft+verify step over batch_size sequences.

        drafted / accepted / emitted are per-row counts (a sequence of batch_size ints) or
        their totals; the accepted-length histogram needs the per-row `emitted`.
        """
        if not isinstance(emitted, int):
            if len(emitted) != batch_size:
                raise ValueError(f"emitted has {len(emitted)} rows, batch_size is {batch_size}")
            self.accepted_length_hist.update(int(e) for e in emitted)
        name = strategy.name if isinstance(strategy, Strategy) else str(strategy)
        totals = self.spec.setdefault(name, _SpecTotals())
        totals.add(
            _SpecTotals(
                steps=1,
                rows=batch_size,
                drafted=_total(drafted),
                accepted=_total(accepted),
                emitted=_total(emitted),
                seconds=draft_seconds + verify_seconds,
            )
        )
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

    def record_phase(self, phase: str, seconds: float) -> None:
        """Time spent outside decode steps (e.g. "prefill", "drafter_train")."""
        self.other_seconds[phase] += seconds

    @property
    def spec_totals(self) -> _SpecTotals:
        out = _SpecTotals()
        for t in self.spec.values():
            out.add(t)
        return out

    def summary(self) -> dict[str, object]:
        """A JSON-able digest: steps per mode, tokens/s per mode, accepted length, phases."""
        sd = self.spec_totals
        steps = self.plain_steps + sd.steps
        tokens = self.plain_tokens + sd.emitted
        decode_seconds = self.plain_seconds + sd.seconds
        return {
            "steps": {"plain": self.plain_steps, "spec": sd.steps, "total": steps},
            "sd_step_share": _ratio(sd.steps, steps),
            "tokens": {"plain": self.plain_tokens, "spec": sd.emitted, "total": tokens},
            "tokens_per_s": {
                "plain": _ratio(self.plain_tokens, self.plain_seconds),
                "spec": _ratio(sd.emitted, sd.seconds),
                "decode": _ratio(tokens, decode_seconds),
            },
            "mean_batch": {
                "plain": _ratio(self.plain_rows, self.plain_steps),
                "spec": _ratio(sd.rows, sd.steps),
            },
            "mean_accepted_length": _ratio(sd.emitted, sd.rows),
            "acceptance_rate": _ratio(sd.accepted, sd.drafted),
            "accepted_length_hist": dict(sorted(self.accepted_length_hist.items())),
            "seconds": {
                "plain_decode": self.plain_seconds,
                "draft": self.draft_seconds,
                "verify": self.verify_seconds,
                **dict(sorted(self.other_seconds.items())),
            },
            "per_strategy": {name: t.as_dict() for name, t in sorted(self.spec.items())},
        }

    def merge(self, other: EngineStats) -> None:
        """Add another engine's (or another period's) counters into this one."""
        self.plain_steps += other.plain_steps
        self.plain_rows += other.plain_rows
        self.plain_tokens += other.plain_tokens
        self.plain_seconds += other.plain_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        for name, t in other.spec.items():
            self.spec.setdefault(name, _SpecTotals()).add(t)
        self.accepted_length_hist.update(other.accepted_length_hist)
        self.other_seconds.update(other.other_seconds)

    def reset(self) -> None:
        """Zero every counter (e.g. after a stats report)."""
        fresh = EngineStats()
        self.__dict__.update(fresh.__dict__)
