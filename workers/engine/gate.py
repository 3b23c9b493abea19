"""What the SD gate learns for one job: acceptance per drafter, the bandit, when to drop them."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tltd_workers.engine.bandit import (
    PLAIN,
    BucketedEpsilonGreedy,
    FixedStrategy,
    NoStrategyAvailable,
    Strategy,
)
from tltd_workers.engine.costs import CostModel, arm_rewards, expected_tokens

DEFAULT_ACCEPTANCE = 0.5  # per-position acceptance assumed for a drafter never observed
PRIOR_POSITIONS = 16.0  # the prior acceptance counts as this many drafted positions
PRIOR_ROWS = 4.0  # the prior coverage (every row drafts) counts as this many row-steps
CHECK_POSITIONS = 64  # draft positions observed under a new policy before comparing
MAX_DROP = 0.25  # a relative fall in acceptance beyond this drops a drafter's state


@dataclass
class Acceptance:
    """How well one drafter's drafts are accepted, learned from the SD steps that used it.

    alpha = accepted / (accepted + rejected) draft positions is the maximum-likelihood
    per-position acceptance when each position is kept independently with probability alpha
    (a row's chain ends at its first rejection, so a row-step rejects at most once);
    coverage = the share of speculating rows that drafted at all (an n-gram drafter finds no
    match for some rows). Both start from a prior worth PRIOR_POSITIONS / PRIOR_ROWS
    observations, so a handful of steps moves them and a single one does not.
    """

    prior: float = DEFAULT_ACCEPTANCE
    prior_coverage: float = 1.0
    accepted: int = 0
    rejected: int = 0
    rows: int = 0
    drafting_rows: int = 0
    steps: int = 0  # SD steps observed since the drafter was (re)set
    baseline: float | None = None  # alpha when the policy changed, until checked
    since: tuple[int, int] = (0, 0)  # (accepted, rejected) positions since that change

    @property
    def alpha(self) -> float:
        seen = self.accepted + self.rejected
        return (self.accepted + self.prior * PRIOR_POSITIONS) / (seen + PRIOR_POSITIONS)

    @property
    def coverage(self) -> float:
        return (self.drafting_rows + self.prior_coverage * PRIOR_ROWS) / (self.rows + PRIOR_ROWS)

    def tokens_per_step(self, k: int) -> float:
        """Expected tokens a row gains per SD step with k drafts."""
        return expected_tokens(self.alpha, self.coverage, k)

    def observe(self, drafted: Sequence[int], accepted: Sequence[int]) -> bool:
        """Add one SD step (per row: drafts verified, drafts accepted). True when it completes
        a check under a new policy that found acceptance fallen by more than MAX_DROP: the
        estimate then restarts from the new policy's observations (the caller forgets the
        rewards measured with this drafter)."""
        acc = sum(accepted)
        rej = sum(1 for d, n in zip(drafted, accepted, strict=True) if d and n < d)
        self.accepted += acc
        self.rejected += rej
        self.rows += len(drafted)
        self.drafting_rows += sum(1 for d in drafted if d)
        self.steps += 1
        if self.baseline is None:
            return False
        a, r = self.since[0] + acc, self.since[1] + rej
        self.since = (a, r)
        if a + r < CHECK_POSITIONS:
            return False
        fell = a / (a + r) < (1.0 - MAX_DROP) * self.baseline
        self.baseline, self.since = None, (0, 0)
        if fell:
            self.prior, self.accepted, self.rejected = DEFAULT_ACCEPTANCE, a, r
        return fell

    def new_policy(self) -> None:
        """The target changed: keep the estimate, and check it against the next positions."""
        self.baseline, self.since = self.alpha, (0, 0)

    def new_drafter(self) -> None:
        """Another drafter (version): the current estimate becomes its prior, worth only
        PRIOR_POSITIONS positions, so the new drafter's own observations soon dominate."""
        self.prior, self.prior_coverage = self.alpha, self.coverage
        self.accepted = self.rejected = self.rows = self.drafting_rows = self.steps = 0
        self.baseline, self.since = None, (0, 0)


class GateState:
    """The adaptive engine's memory for one job, kept across its requests (and engines).

    Every RL step replays the same prompt distribution, so what step 1 learned (rewards per
    bucket and arm, acceptance per drafter) is where step 2 starts. The decode costs are not
    part of it: they depend on the architecture and device, not on weights. A drafter that
    has not run since it was (re)set is `untried`: the engine runs it for one step as soon as
    it is available, so its acceptance is measured rather than assumed (the prior alone could
    keep a good drafter from ever running).

    Reset rule, applied by `sync` with the versions in use at each decode step:
    - a new EAGLE drafter version: the EAGLE acceptance estimate is demoted to a prior worth
      PRIOR_POSITIONS positions (a new version is usually its predecessor trained further on
      newer rollouts; its own observations outweigh the prior within a few steps) and the
      rewards measured with EAGLE strategies are forgotten in every bucket. N-gram state is
      kept. Unloading the drafter (version 0) is no change: the next version set is compared
      with the last one seen.
    - a new policy version: everything is kept (an RL step moves the policy little), and each
      drafter's next CHECK_POSITIONS draft positions are compared with its estimate from
      before: if acceptance fell by more than MAX_DROP (relative), that drafter's estimate
      restarts from those positions and its strategies' rewards are forgotten.
    - the first prompt admitted with answers of an earlier request in the history drafter (the
      job's second epoch, or the store's answers after a restart): the history drafter's
      estimate and rewards restart (`history_arrived`). Measured before, in the first epoch's
      tails with finished siblings at most, they would rank it for every later epoch by what
      it does without a history, and the bandit would seldom try it again.
    """

    def __init__(self, bandit: BucketedEpsilonGreedy) -> None:
        self.bandit = bandit
        self.acceptance = {d: Acceptance() for d in sorted(bandit.drafters)}
        self.policy_version: int | None = None  # None: nothing seen yet
        self.drafter_version = 0  # the last EAGLE drafter version seen (0: none yet)
        self.history_seen = False  # a prompt arrived with earlier requests' answers

    def fits(self, strategies: Sequence[Strategy], buckets: Sequence[int], plain_arm: bool) -> bool:
        """Whether an engine with this configuration can continue from this state."""
        b = self.bandit
        return (b.strategies, b.buckets, b.plain_arm) == (
            tuple(strategies),
            tuple(buckets),
            plain_arm,
        )

    def sync(self, policy_version: int, drafter_version: int) -> None:
        """Apply the reset rule (class docstring) for the versions in use now."""
        if self.policy_version is not None and policy_version != self.policy_version:
            for a in self.acceptance.values():
                a.new_policy()
        self.policy_version = policy_version
        if drafter_version and drafter_version != self.drafter_version:
            if "eagle" in self.acceptance:
                self.acceptance["eagle"].new_drafter()
            self.bandit.forget("eagle")
            self.drafter_version = drafter_version

    def history_arrived(self) -> None:
        """A prompt was admitted with answers of earlier requests in the history drafter: the
        first time, the history drafter's estimate and rewards restart (class docstring)."""
        if self.history_seen:
            return
        self.history_seen = True
        if "history" in self.acceptance:
            self.acceptance["history"] = Acceptance()
            self.bandit.forget("history")

    def untried(self, available: Collection[str]) -> str | None:
        """An available drafter with no SD step since it was (re)set, if any."""
        return next((d for d, a in self.acceptance.items() if d in available and not a.steps), None)

    def observe(self, drafter: str, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Learn from one SD step of `drafter` (per row: drafts verified, drafts accepted)."""
        if self.acceptance[drafter].observe(drafted, accepted):
            self.bandit.forget(drafter)

    def tokens_per_step(self) -> dict[Strategy, float]:
        """Expected tokens a row gains per SD step, per strategy."""
        return {s: self.acceptance[s.drafter].tokens_per_step(s.k) for s in self.bandit.strategies}

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per drafter: alpha, coverage, observed positions and tokens per step per k."""
        ks = sorted({s.k for s in self.bandit.strategies})
        return {
            d: {
                "alpha": a.alpha,
                "coverage": a.coverage,
                "positions": a.accepted + a.rejected,
                "tokens_per_step": {k: a.tokens_per_step(k) for k in ks},
            }
            for d, a in self.acceptance.items()
        }


def arm_priors(
    costs: CostModel | None, gate_state: GateState | None, batch_size: int
) -> dict[str, float] | None:
    """Predicted tokens/s per arm at this batch size's bucket (None: no cost model there)."""
    if costs is None or gate_state is None:
        return None
    bucket = gate_state.bandit.bucket(batch_size)
    cost = costs.buckets.get(bucket)
    if cost is None:
        return None
    return arm_rewards(cost, bucket, gate_state.tokens_per_step())


def choose_arm(
    bandit: BucketedEpsilonGreedy | FixedStrategy,
    gate_state: GateState | None,
    costs: CostModel | None,
    batch_size: int,
    available: Collection[str],
    versions: tuple[int, int],
) -> Strategy | None:
    """The adaptive gate's arm for a decode step of `batch_size` rows, None for a plain step: a
    pure function of what the gate learned, the cost model and the drafters `available` now
    (the engine calls it with measured costs; a simulator with a device's cost model).
    `versions`: the (policy, EAGLE drafter) versions in use, for the reset rule."""
    if gate_state is not None:
        gate_state.sync(*versions)
    untried = gate_state.untried(available) if gate_state is not None else None
    try:
        return bandit.choose(
            batch_size, available, arm_priors(costs, gate_state, batch_size), untried
        )
    except NoStrategyAvailable:
        return None


def verdicts(
    snapshot: Mapping[int, Mapping[str, Mapping[str, float | int | None]]],
) -> dict[int, dict[str, object]]:
    """Per bucket of an engine's strategy snapshot (per arm: median_reward, predicted_reward,
    estimate): the predicted best arm and its gain over plain decoding (best SD arm's tokens/s
    / plain's), the same from measured rewards only, and whether the gate speculates there:
    what its current estimates favour, or the prediction where no strategy has one yet."""
    out: dict[int, dict[str, object]] = {}
    for bucket, arms in sorted(snapshot.items()):
        predicted = _best({n: a.get("predicted_reward") for n, a in arms.items()})
        measured = _best({n: a.get("median_reward") for n, a in arms.items()})
        estimates = {n: a.get("estimate") for n, a in arms.items()}
        now = _best(estimates)
        known = any(e is not None and n != PLAIN for n, e in estimates.items())
        choice = now[0] if known else predicted[0]
        out[bucket] = {
            "predicted_arm": predicted[0],
            "predicted_gain": predicted[1],
            "measured_arm": measured[0],
            "measured_gain": measured[1],
            "speculates": choice is not None and choice != PLAIN,
        }
    return out


def _best(rewards: Mapping[str, float | int | None]) -> tuple[str | None, float | None]:
    """(best arm, best SD arm's reward / plain's) among the arms with a finite reward."""
    known = {n: float(r) for n, r in rewards.items() if r is not None and r > float("-inf")}
    if not known:
        return None, None
    best = max(known, key=known.__getitem__)
    sd = [r for n, r in known.items() if n != PLAIN]
    gain = max(sd) / known[PLAIN] if sd and known.get(PLAIN) else None
    return best, gain
