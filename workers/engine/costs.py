"""Decode-step costs measured on the device per batch bucket, and the SD gain they predict.

Speculation pays at a batch size when the tokens a row gains per SD step outweigh what the
step costs against a plain step (DESIGN.md §7):

    gain = tokens per step * plain_ms / (verify_ms(k) + k * draft_ms)

On a GPU serving a large policy verify ~ plain up to batch ~64, hence TLT's fixed "SD at
<= 32"; on a CPU the ratio depends on the model's shape, so the engine measures it.
`measure_costs` times real forwards (the only clock here); `arm_rewards` and `predict` are
pure functions of the measured costs and the accepted-length estimates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tltd_workers.engine.bandit import PLAIN, Strategy
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.transformer import Batch, CausalLM


@dataclass(frozen=True)
class BucketCost:
    """Milliseconds of one forward at a batch size, each row holding the measured context."""

    plain_ms: float  # one target forward, 1 new token per row
    verify_ms: Mapping[int, float]  # tokens per row (k + 1) -> one target forward
    draft_ms: float  # one step of a one-layer EAGLE drafter

    def verify(self, k: int) -> float:
        """ms of verifying k drafts (+ the pending token) per row: piecewise linear in the
        width between the measured widths and the plain step (width 1), extrapolated from the
        last two beyond them (a forward's cost is nearly linear in its tokens)."""
        points = sorted({1: self.plain_ms, **self.verify_ms}.items())
        width = k + 1
        if len(points) == 1:  # nothing but the plain step: assume no better than k + 1 steps
            return self.plain_ms * width
        i = next((i for i in range(1, len(points)) if width <= points[i][0]), len(points) - 1)
        (w0, c0), (w1, c1) = points[i - 1], points[i]
        return c0 + (c1 - c0) * (width - w0) / (w1 - w0)

    def step_ms(self, strategy: Strategy) -> float:
        """One SD step: draft (free for n-grams: a dictionary look-up) + verify."""
        draft = strategy.k * self.draft_ms if strategy.drafter == "eagle" else 0.0
        return self.verify(strategy.k) + draft


@dataclass(frozen=True)
class CostModel:
    """Costs per batch bucket measured on this device; `key` says what they are valid for
    (architecture, dtype, device, threads, context, batch sizes): a cost model measured for
    one engine is reused by the next one with the same key (None: any engine it is given to,
    e.g. numbers stated by a test or a benchmark)."""

    buckets: Mapping[int, BucketCost]
    context: int
    seconds: float = 0.0  # wall time the measurement took
    key: Hashable = None

    def as_dict(self) -> dict[str, object]:
        return {
            "context": self.context,
            "seconds": self.seconds,
            "buckets": {
                b: {"plain_ms": c.plain_ms, "verify_ms": dict(c.verify_ms), "draft_ms": c.draft_ms}
                for b, c in sorted(self.buckets.items())
            },
        }


def expected_tokens(alpha: float, coverage: float, k: int) -> float:
    """Tokens a row gains per SD step with k drafts (accepted drafts + the target's own).

    A row that drafts (probability `coverage`) keeps each draft with probability alpha until
    the first rejection: E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)
    (Leviathan et al. 2023); a row that drafts nothing gains 1 token.
    """
    full = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return coverage * full + (1.0 - coverage)


def arm_rewards(cost: BucketCost, batch: int, tokens: Mapping[Strategy, float]) -> dict[str, float]:
    """Predicted tokens/s at `batch` rows of plain decoding (PLAIN) and of each strategy,
    given the tokens a row gains per step with it (`tokens`)."""
    out = {PLAIN: 1000.0 * batch / cost.plain_ms}
    for s, t in tokens.items():
        out[s.name] = 1000.0 * batch * t / cost.step_ms(s)
    return out


def fallback_pays(
    cost: BucketCost,
    bucket: int,
    batch: int,
    history_rows: int,
    history_tokens: float,
    history_positions: int,
    fallback_rows: int,
    eagle_tokens: float,
    k: int,
    backlog_positions: int = 0,
) -> bool:
    """Whether a history step's rows without a history draft should draft with EAGLE.

    Without: the step verifies the `history_rows`' drafts (`history_positions` in all,
    expected to gain `history_tokens` over those rows) and decodes every other row plainly.
    EAGLE on the `fallback_rows` adds k positions each to the verify pass and k drafter
    steps over the whole batch, for `eagle_tokens - 1` more tokens per such row. It pays
    when those tokens come at least at the step's own rate: the time they cost would
    otherwise go to steps like this one. At large batch, where the history rows' drafts are
    long and the batch is dear to draft for, it does not; at small batch it usually does.
    Marginal costs per row and per verified position come from the bucket's measured
    forwards (`bucket` rows). `backlog_positions`: positions the drafter has not seen yet
    (rows that decoded without it, prompts after a prefill), which it takes in first at
    about a drafter step's cost per row each.
    """
    if fallback_rows <= 0 or k <= 0:
        return False
    scale = batch / bucket
    per_position = max(0.0, cost.verify(k) - cost.plain_ms) / (k * bucket)
    base_ms = cost.plain_ms * scale + history_positions * per_position
    base_tokens = history_tokens + (batch - history_rows)
    extra_ms = (
        fallback_rows * k * per_position
        + k * cost.draft_ms * scale
        + backlog_positions * cost.draft_ms / bucket
    )
    extra_tokens = fallback_rows * (eagle_tokens - 1.0)
    return extra_tokens * base_ms > base_tokens * extra_ms


@dataclass(frozen=True)
class Prediction:
    """One bucket's prediction: tokens/s per arm, the best arm, and its gain over plain."""

    rewards: Mapping[str, float]
    best: str
    gain: float  # best SD arm's tokens/s / plain's: > 1 where speculation pays


def predict(costs: CostModel, tokens: Mapping[Strategy, float]) -> dict[int, Prediction]:
    """Per measured bucket: which arm (a strategy or PLAIN) is predicted to be fastest."""
    out: dict[int, Prediction] = {}
    for b, cost in sorted(costs.buckets.items()):
        rewards = arm_rewards(cost, b, tokens)
        sd = max((r for name, r in rewards.items() if name != PLAIN), default=0.0)
        best = max(rewards, key=rewards.__getitem__)
        out[b] = Prediction(rewards, best, sd / rewards[PLAIN])
    return out


# -- measurement (the clock lives here, not in the decisions above) ---------------------------


def measure_costs(
    model: CausalLM,
    cache: KVCache,
    batches: Sequence[int],
    ks: Sequence[int],
    context: int,
    budget_s: float,
    rounds: int = 5,
    key: Hashable = None,
) -> CostModel:
    """Time plain, verify and EAGLE-draft forwards of `model` per batch size.

    `cache` is scratch space (the engine's own, while it is empty): rows [0, b) hold `context`
    positions (ragged by a few, as a running batch is) of whatever the cache contains, which
    costs the same as real keys; its lengths are restored. Verification is timed at the
    shortest and longest k + 1 (others are interpolated); the draft step with a randomly
    initialised one-layer drafter of the model's shape (its cost does not depend on weights).

    Within `budget_s`: the first round goes smallest batch first and stops before a batch
    whose projected time would not fit (batches not reached have no cost; the engine then
    measures them online); up to `rounds` - 1 more rounds re-time every batch that still
    fits, keeping each shape's fastest time (the least disturbed). On a shared CPU single
    timings still swing, so `smoothed` then takes each ratio to the plain step over
    neighbouring batch sizes.
    """
    start = time.perf_counter()
    batches = sorted(b for b in set(batches) if b <= cache.slots)
    # Widths that fit the cache beside a context of >= 8 positions (a short max_seq_len and
    # the history arms' long drafts need not): wider ones are extrapolated (`verify`).
    widths = sorted(w for w in {min(ks) + 1, max(ks) + 1} if w <= cache.max_len - 8)
    context = max(8, min(context, cache.max_len - (widths[-1] if widths else 1)))
    if not batches or budget_s <= 0:
        return CostModel({}, context, 0.0, key)
    timer = _Timer(model, cache, widths, context, batches[-1], start + budget_s)
    saved = list(cache.lens)
    try:
        timer.run(batches, rounds)
    finally:
        cache.lens[:] = saved
    return CostModel(smoothed(timer.costs()), context, time.perf_counter() - start, key)


class _Timer:
    """The fastest time of each forward shape per batch size, timed until a deadline
    (measure_costs says in which order)."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        widths: Sequence[int],
        context: int,
        max_batch: int,
        deadline: float,
    ) -> None:
        self.model, self.cache, self.widths, self.context = model, cache, widths, context
        self.drafter = EagleDrafter.random_init(model)
        self.dcache = self.drafter.new_cache(max_batch, context + 2)
        self.deadline = deadline  # perf_counter() seconds
        self.best: dict[tuple[int, int], float] = {}  # (batch, width; 0 = a draft step) -> s
        self.took: dict[int, float] = {}  # batch -> seconds its last round took

    def run(self, batches: Sequence[int], rounds: int) -> None:
        """A first round smallest batch first, stopping before a batch that would not fit;
        then up to `rounds` - 1 more over the batches reached, each batch while it fits."""
        _target_forward(self.model, self.cache, batches[0], 1, self.context)  # first-call allocs
        for i, b in enumerate(batches):
            prev = batches[i - 1] if i else None
            if prev is not None and not self._fits(self.took[prev] * b / prev):
                break
            self._time_batch(b)
        for _ in range(rounds - 1):
            for b in sorted(self.took):
                if self._fits(self.took[b]):
                    self._time_batch(b)

    def costs(self) -> dict[int, BucketCost]:
        """Milliseconds per batch size reached."""
        best, widths = self.best, self.widths
        return {
            b: BucketCost(
                1000 * best[(b, 1)], {w: 1000 * best[(b, w)] for w in widths}, 1000 * best[(b, 0)]
            )
            for b in sorted(self.took)
        }

    def _fits(self, seconds: float) -> bool:
        return time.perf_counter() + seconds <= self.deadline

    def _time_batch(self, b: int) -> None:
        t_batch = time.perf_counter()
        for w in (1, *self.widths, 0):
            t0 = time.perf_counter()
            if w:
                _target_forward(self.model, self.cache, b, w, self.context)
            else:
                _draft_step(self.drafter, self.dcache, b, self.context)
            if self.cache.k.is_cuda:  # kernels run asynchronously: wait for them
                torch.cuda.synchronize(self.cache.k.device)
            self.best[(b, w)] = min(self.best.get((b, w), float("inf")), time.perf_counter() - t0)
        self.took[b] = time.perf_counter() - t_batch


def smoothed(costs: Mapping[int, BucketCost]) -> dict[int, BucketCost]:
    """Each bucket's verify and draft costs as its plain step x the median, over the 3 nearest
    batch sizes (its own included), of their ratio to the plain step: the ratio changes slowly
    with the batch size, while a timing disturbed by another process does not repeat at the
    next size."""
    order = sorted(costs)
    out: dict[int, BucketCost] = {}
    for i, b in enumerate(order):
        lo = max(0, min(i - 1, len(order) - 3))  # the 3 nearest sizes, at the ends too
        near = [costs[n] for n in order[lo : lo + 3]]
        plain = costs[b].plain_ms
        verify = {
            w: plain * _median_ratio(near, lambda c, w=w: c.verify_ms[w])
            for w in costs[b].verify_ms
        }
        out[b] = BucketCost(plain, verify, plain * _median_ratio(near, lambda c: c.draft_ms))
    return out


def _median_ratio(costs: Sequence[BucketCost], part: Callable[[BucketCost], float]) -> float:
    return statistics.median(part(c) / c.plain_ms for c in costs)


def _lens(b: int, context: int) -> list[int]:
    return [context - (i % 7) for i in range(b)]


def _target_forward(model: CausalLM, cache: KVCache, b: int, width: int, context: int) -> None:
    dev = cache.k.device
    tokens = (torch.arange(b * width, device=dev) % model.config.vocab_size).view(b, width)
    batch = Batch.make(_lens(b, context), None, width, 0, cache.trash, dev)
    # Verification computes logits at every position, as the engine's verify pass does.
    model(tokens, cache, batch, last_only=width == 1)


@torch.inference_mode()
def _draft_step(drafter: EagleDrafter, cache: KVCache, b: int, context: int) -> None:
    dev = cache.k.device
    h = torch.zeros(b, 1, drafter.config.hidden_size, dtype=cache.k.dtype, device=dev)
    tok = torch.ones(b, 1, dtype=torch.long, device=dev)
    batch = Batch.make(_lens(b, context), [1] * b, 1, 0, cache.trash, dev)
    drafter.logits(drafter._step(h, tok, batch, cache))
