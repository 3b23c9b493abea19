"""TLT's BEG: a bucketed epsilon-greedy choice of speculative-decoding strategy."""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

PLAIN = "plain"  # the arm that decodes one token per row, without speculation
# A predicted reward counts as this many measured steps: measured rewards outweigh it after a
# few steps, and one noisy step does not overturn it.
PRIOR_WEIGHT = 2.0


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


def arm_name(arm: Strategy | None) -> str:
    """A strategy's name; PLAIN for None (the plain arm)."""
    return PLAIN if arm is None else arm.name


def estimate(prior: float | None, median: float | None, count: int) -> float:
    """An arm's expected reward: the median of its `count` measured rewards blended with a
    predicted prior worth PRIOR_WEIGHT steps; either alone when the other is missing, -inf
    with neither (an untried arm without a prediction)."""
    if prior is None:
        return float("-inf") if median is None else median
    if median is None or count == 0:
        return prior
    return (count * median + PRIOR_WEIGHT * prior) / (count + PRIOR_WEIGHT)


class NoStrategyAvailable(LookupError):
    """None of a policy's strategies uses an available drafter: decode without SD."""


class BucketedEpsilonGreedy:
    """Per batch-size bucket, pick the strategy with the best median recent reward.

    Reward = accepted tokens x batch size / step seconds, i.e. the throughput the step
    achieved. The best strategy depends on the batch size (a long draft pays at batch 1 and
    wastes verify compute at batch 32), hence one bandit per bucket. The median over a sliding
    window, rather than the mean, ignores the occasional slow step (allocator, GC, a
    co-scheduled drafter-training step) and the window lets it follow a drafter that improves.

    Two extensions for devices where speculation need not pay at every batch size:
    `plain_arm` makes plain decoding an arm (choose() returns None for it, rewarded by
    `record_plain`), and `priors` (rewards predicted from costs measured on the device) start
    a bucket from a prediction instead of trying every arm.

    Of a prediction only each strategy's gain over plain decoding in the bucket is used: a
    ratio of forwards timed side by side, which holds on a busier or quieter device. A bucket
    measures plain decoding first; a strategy's prior there is its predicted gain x that
    measured plain reward x its drafter's efficiency in the bucket, the median ratio of
    measured to so-predicted reward over the drafter's recent steps there, blended with 1
    like a prior (1 before it ran: the predicted gain is taken at face value, so the
    predicted best strategy is tried where it is predicted to pay). The efficiency carries
    what one strategy measured to the drafter's other draft lengths: what the timed forwards
    leave out (drafting in Python, sampling, the accept rule) and errors of the predicted
    accepted length.
    """

    def __init__(
        self,
        strategies: Sequence[Strategy],
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        epsilon: float = 0.1,
        window: int = 300,
        seed: int = 0,
        plain_arm: bool = False,
        explore_margin: float = 0.2,
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
        if not 0.0 <= explore_margin <= 1.0:
            raise ValueError(f"explore_margin must be in [0, 1], got {explore_margin}")
        self.strategies = tuple(strategies)
        self.buckets = tuple(buckets)
        self.epsilon = epsilon
        self.window = window
        self.plain_arm = plain_arm
        self.explore_margin = explore_margin
        self._rng = random.Random(seed)
        self._arms: tuple[Strategy | None, ...] = ((None,) if plain_arm else ()) + self.strategies
        self._rewards: dict[tuple[int, Strategy | None], deque[float]] = {
            (b, a): deque(maxlen=window) for b in self.buckets for a in self._arms
        }
        self._counts = dict.fromkeys(self._rewards, 0)
        self._median_cache: dict[tuple[int, Strategy | None], float | None] = {}
        # The prior (before efficiency) of the strategy the last choose returned, until its
        # reward is recorded: measured / this is the drafter's efficiency.
        self._pending: tuple[tuple[int, Strategy], float] | None = None
        # (bucket, drafter) -> measured / predicted rewards of its strategies there
        self._efficiency: dict[tuple[int, str], deque[float]] = {}
        self._efficiency_cache: dict[tuple[int, str], float] = {}

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

    def choose(
        self,
        batch_size: int,
        available: Collection[str] | None = None,
        priors: Mapping[str, float] | None = None,
        explore: str | None = None,
    ) -> Strategy | None:
        """Pick the arm of a step at this batch size: a strategy of an available drafter, or
        None to decode plainly (plain_arm only).

        Without a prior for every arm: untried arms first (plain, then declaration order);
        then with probability epsilon a uniformly random arm; else the best median reward over
        the bucket's window (ties: declaration order).

        With priors (predicted tokens/s per arm name, plain_arm only): plain decoding runs
        once in a bucket first (the baseline); then the best `estimate`, whose prior comes
        from the predicted gain (class docstring), so a bucket starts from the prediction and
        follows the measured rewards. With probability epsilon a random *contender* runs
        instead, an arm whose estimate is within explore_margin of the best: exploration
        costs at most epsilon x explore_margin of the best arm's throughput, and arms
        predicted to be clearly worse are not tried. `explore` names a drafter to run now
        whatever the estimates say (its best strategy, after the baseline), e.g. one whose
        acceptance was never measured.
        """
        b = self.bucket(batch_size)
        sd = [s for s in self.strategies if available is None or s.drafter in available]
        if not sd:
            raise NoStrategyAvailable(f"no strategy uses an available drafter ({available})")
        arms: list[Strategy | None] = ([None] if self.plain_arm else []) + sd
        if not self.plain_arm or priors is None or any(arm_name(a) not in priors for a in arms):
            for a in arms:
                if not self._rewards[(b, a)]:
                    return a
            if self._rng.random() < self.epsilon:
                return arms[self._rng.randrange(len(arms))]
            return max(arms, key=lambda a: estimate(None, self._median(b, a), 0))
        if not self._rewards[(b, None)]:
            return None
        est = self._estimates(b, arms, priors)
        forced = [s for s in sd if s.drafter == explore]
        pick = max(forced or arms, key=est.__getitem__)
        if not forced and self._rng.random() < self.epsilon:
            floor = (1.0 - self.explore_margin) * est[pick]
            contenders = [a for a in arms if est[a] >= floor]
            pick = contenders[self._rng.randrange(len(contenders))]
        prior = None if pick is None else self._prior(b, pick, priors)
        self._pending = None if pick is None or prior is None else ((b, pick), prior)
        return pick

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
        self._add(key, accepted_tokens * batch_size / max(step_seconds, 1e-9))

    def record_plain(self, batch_size: int, step_seconds: float) -> None:
        """Record one plain decode step (plain_arm): reward = batch_size / step_seconds."""
        if not self.plain_arm:
            raise ValueError("this bandit has no plain arm")
        self._add((self.bucket(batch_size), None), batch_size / max(step_seconds, 1e-9))

    def forget(self, drafter: str) -> None:
        """Drop the rewards measured with `drafter`'s strategies in every bucket (the drafter
        changed); total counts stay, as statistics."""
        for key, window in self._rewards.items():
            if key[1] is not None and key[1].drafter == drafter:
                window.clear()
                self._median_cache.pop(key, None)
        for b in self.buckets:
            self._efficiency.pop((b, drafter), None)
            self._efficiency_cache.pop((b, drafter), None)

    def efficiency(self, batch_size: int, drafter: str) -> float:
        """Measured / predicted reward of the drafter's strategies in this batch size's
        bucket: the median of the ratios blended with 1.0 (the prediction taken at face
        value) worth PRIOR_WEIGHT steps; 1.0 before any ran there with a prediction.

        The blend keeps one unlucky step from condemning a drafter in a bucket: a single
        EAGLE step that kept none of its 6 drafts measures ~0.3 of its prediction, and taken
        alone that ratio would price every EAGLE arm of the bucket below plain decoding, so
        that no EAGLE step would run there again to correct it."""
        key = (self.bucket(batch_size), drafter)
        if key not in self._efficiency_cache:
            ratios = self._efficiency.get(key)
            self._efficiency_cache[key] = (
                estimate(1.0, statistics.median(ratios), len(ratios)) if ratios else 1.0
            )
        return self._efficiency_cache[key]

    def snapshot(self) -> dict[int, dict[str, dict[str, float | int | None]]]:
        """Per bucket, per arm name (PLAIN too with plain_arm): total count and the window's
        median reward."""
        return {
            b: {
                arm_name(a): {"count": self._counts[(b, a)], "median_reward": self._median(b, a)}
                for a in self._arms
            }
            for b in self.buckets
        }

    def estimates(
        self, batch_size: int, priors: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Every arm's `estimate` (tokens/s) in this batch size's bucket."""
        b = self.bucket(batch_size)
        return {arm_name(a): e for a, e in self._estimates(b, self._arms, priors).items()}

    def _prior(self, b: int, s: Strategy, priors: Mapping[str, float]) -> float | None:
        """Predicted gain of `s` over plain decoding x plain's measured reward (None when
        either is unknown), before the drafter's efficiency."""
        plain = self._median(b, None) if self.plain_arm else None
        if plain is None or not priors.get(PLAIN) or s.name not in priors:
            return None
        return priors[s.name] / priors[PLAIN] * plain

    def _estimates(
        self, b: int, arms: Sequence[Strategy | None], priors: Mapping[str, float] | None
    ) -> dict[Strategy | None, float]:
        out: dict[Strategy | None, float] = {}
        for a in arms:
            prior = None
            if a is not None and priors is not None:
                prior = self._prior(b, a, priors)
                if prior is not None:
                    prior *= self.efficiency(b, a.drafter)
            out[a] = estimate(prior, self._median(b, a), len(self._rewards[(b, a)]))
        return out

    def _add(self, key: tuple[int, Strategy | None], reward: float) -> None:
        self._rewards[key].append(reward)
        self._counts[key] += 1
        self._median_cache.pop(key, None)
        if self._pending is not None and self._pending[0] == key and key[1] is not None:
            eff = (key[0], key[1].drafter)
            self._efficiency.setdefault(eff, deque(maxlen=self.window))
            self._efficiency[eff].append(reward / max(self._pending[1], 1e-12))
            self._efficiency_cache.pop(eff, None)
        self._pending = None

    def _median(self, b: int, a: Strategy | None) -> float | None:
        key = (b, a)
        if key not in self._median_cache:
            window = self._rewards[key]
            self._median_cache[key] = statistics.median(window) if window else None
        return self._median_cache[key]


class FixedStrategy:
    """Always the same strategy (ablations); same interface as BucketedEpsilonGreedy."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.strategies = (strategy,)
        self._counts: dict[int, int] = {}

    @property
    def drafters(self) -> frozenset[str]:
        return frozenset({self.strategy.drafter})

    def choose(
        self,
        batch_size: int,
        available: Collection[str] | None = None,
        priors: Mapping[str, float] | None = None,
        explore: str | None = None,
    ) -> Strategy:
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
