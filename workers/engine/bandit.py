"""TLT's BEG: a bucketed epsilon-greedy choice of speculative-decoding strategy."""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Strategy:
    """One arm: which drafter proposes, and how many tokens it drafts per step."""

    drafter: str  # "ngram" | "eagle"
    k: int  # draft length

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"draft length k must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        return f"{self.drafter}/k{self.k}"


class NoStrategyAvailable(LookupError):
    """None of a policy's strategies uses an available drafter: decode without SD."""


class StrategyPolicy(Protocol):
    """What the engine needs from a strategy chooser (BEG or a fixed ablation)."""

    @property
    def drafters(self) -> frozenset[str]: ...

    def choose(self, batch_size: int, available: Collection[str] | None = None) -> Strategy: ...

    def record(
        self, batch_size: int, strategy: Strategy, accepted_tokens: float, step_seconds: float
    ) -> None: ...

    def snapshot(self) -> dict[int, dict[str, dict[str, float | int | None]]]: ...


class BucketedEpsilonGreedy:
    """Per batch-size bucket, pick the strategy with the best median recent reward.

    Reward = accepted tokens x batch size / step seconds, i.e. the throughput the step
    achieved. The best strategy depends on the batch size (a long draft pays at batch 1 and
    wastes verify compute at batch 32), hence one bandit per bucket. The median over a sliding
    window, rather than the mean, ignores the occasional slow step (allocator, GC, a
    co-scheduled drafter-training step) and the window lets it follow a drafter that improves.
    """

    def __init__(
        self,
        strategies: Sequence[Strategy],
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        epsilon: float = 0.1,
        window: int = 300,
        seed: int = 0,
    ) -> None:
        if not strategies:
            raise ValueError("need at least one strategy")
        if len(set(strategies)) != len(strategies):
            raise ValueError("strategies must be distinct")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be strictly increasing positive ints, got {buckets}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.strategies = tuple(strategies)
        self.buckets = tuple(buckets)
        self.epsilon = epsilon
        self.window = window
        self._rng = random.Random(seed)
        self._rewards: dict[tuple[int, Strategy], deque[float]] = {
            (b, s): deque(maxlen=window) for b in self.buckets for s in self.strategies
        }
        self._counts = dict.fromkeys(self._rewards, 0)
        self._median_cache: dict[tuple[int, Strategy], float] = {}

    @property
    def drafters(self) -> frozenset[str]:
        """Drafter names this policy may choose."""
        return frozenset(s.drafter for s in self.strategies)

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket >= batch_size; the last bucket for anything larger."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def choose(self, batch_size: int, available: Collection[str] | None = None) -> Strategy:
        """Pick a strategy for a step at this batch size among the available drafters.

        Untried strategies (in this bucket) go first, in declaration order; then with
        probability epsilon a uniformly random one; else the best median reward over the
        bucket's window (ties: declaration order).
        """
        b = self.bucket(batch_size)
        candidates = [s for s in self.strategies if available is None or s.drafter in available]
        if not candidates:
            raise NoStrategyAvailable(f"no strategy uses an available drafter ({available})")
        for s in candidates:
            if self._counts[(b, s)] == 0:
                return s
        if self._rng.random() < self.epsilon:
            return candidates[self._rng.randrange(len(candidates))]
        return max(candidates, key=lambda s: self._median(b, s))

    def record(
        self, batch_size: int, strategy: Strategy, accepted_tokens: float, step_seconds: float
    ) -> None:
        """Record one SD step's outcome.

        `accepted_tokens` is the mean number of tokens a sequence gained in the step (so
        reward = accepted_tokens * batch_size / step_seconds is the step's throughput).
        """
        key = (self.bucket(batch_size), strategy)
        if key not in self._rewards:
            raise ValueError(f"unknown strategy {strategy}")
        # A zero duration (coarse clock) must not become an infinite reward.
        reward = accepted_tokens * batch_size / max(step_seconds, 1e-9)
        self._rewards[key].append(reward)
        self._counts[key] += 1
        self._median_cache.pop(key, None)

    def snapshot(self) -> dict[int, dict[str, dict[str, float | int | None]]]:
        """Per bucket, per strategy name: total count and the window's median reward."""
        return {
            b: {
                s.name: {
                    "count": self._counts[(b, s)],
                    "median_reward": self._median(b, s) if self._counts[(b, s)] else None,
                }
                for s in self.strategies
            }
            for b in self.buckets
        }

    def _median(self, b: int, s: Strategy) -> float:
        key = (b, s)
        cached = self._median_cache.get(key)
        if cached is None:
            window = self._rewards[key]
            cached = statistics.median(window) if window else float("-inf")
            self._median_cache[key] = cached
        return cached


class FixedStrategy:
    """Always the same strategy (ablations); same interface as BucketedEpsilonGreedy."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.strategies = (strategy,)
        self._counts: dict[int, int] = {}

    @property
    def drafters(self) -> frozenset[str]:
        return frozenset({self.strategy.drafter})

    def choose(self, batch_size: int, available: Collection[str] | None = None) -> Strategy:
        if available is not None and self.strategy.drafter not in available:
            raise NoStrategyAvailable(f"drafter {self.strategy.drafter!r} is not available")
        return self.strategy

    def record(
        self, batch_size: int, strategy: Strategy, accepted_tokens: float, step_seconds: float
    ) -> None:
        self._counts[batch_size] = self._counts.get(batch_size, 0) + 1

    def snapshot(self) -> dict[int, dict[str, dict[str, float | int | None]]]:
        return {
            b: {self.strategy.name: {"count": n, "median_reward": None}}
            for b, n in sorted(self._counts.items())
        }
