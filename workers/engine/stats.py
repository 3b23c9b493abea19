"""Engine statistics: passes and per-row steps, tokens by source and per-token provenance."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tltd.domain import TokenProvenance, TokenSource
from tltd_workers.engine.bandit import Strategy

PLAIN_TOKEN = TokenProvenance(TokenSource.PLAIN)


@functools.cache
def _provenance(source: TokenSource, drafter: str, drafts: int) -> TokenProvenance:
    # Few distinct values (sources x drafters x draft lengths): tokens share these objects.
    return TokenProvenance(source, drafter, drafts)


def step_provenance(n: int, drafts: int, drafter: str) -> list[TokenProvenance]:
    """Provenance of what a row may emit in a verify pass: n accepted drafts, then the token
    drawn by the target (bonus if all `drafts` were kept, else residual); plain if none."""
    if drafts == 0:
        return [PLAIN_TOKEN]
    last = TokenSource.BONUS if n == drafts else TokenSource.RESIDUAL
    accepted = _provenance(TokenSource.ACCEPTED, drafter, drafts)
    return [accepted] * n + [_provenance(last, drafter, drafts)]


@dataclass
class _SpecTotals:
    """Totals of the verify passes taken with one strategy, and of the rows in them.

    A row that had no draft in a verify pass (the n-gram drafter found nothing, speculative
    off for its request, no EAGLE history, at its length limit) decoded a plain step there:
    it is in `rows` and `emitted` but not in `draft_rows`.
    """

    steps: int = 0  # verify passes (one target forward over the batch each)
    rows: int = 0  # rows in them (sum of batch sizes): what the passes cost
    emitted: int = 0  # tokens every row of those passes emitted
    seconds: float = 0.0
    draft_rows: int = 0  # rows that verified >= 1 draft: SD steps of a sequence
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted (not counting drafts past a stop token)
    bonus: int = 0  # tokens drawn from p after a fully accepted chain
    residual: int = 0  # tokens drawn from the residual after a rejected draft

    def add(self, other: _SpecTotals) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "steps": self.steps,
            "rows": self.rows,
            "draft_rows": self.draft_rows,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "bonus": self.bonus,
            "residual": self.residual,
            "emitted": self.emitted,
            "draft_row_share": _ratio(self.draft_rows, self.rows),
            "mean_accepted_length": _ratio(self.accepted + self.draft_rows, self.draft_rows),
            "acceptance_rate": _ratio(self.accepted, self.drafted),
            "tokens_per_s": _ratio(self.emitted, self.seconds),
        }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class PrefillFit:
    """Least squares of a prefill forward's seconds on the positions it computed (padding
    included): the slope is what one more prompt token costs; the rest (sampling, the batch's
    setup) is paid whatever the length. Placement weighs a re-prefill by the slope."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, positions: int, seconds: float) -> None:
        self.n += 1
        self.sx += positions
        self.sy += seconds
        self.sxx += positions * positions
        self.sxy += positions * seconds

    def merge(self, other: PrefillFit) -> None:
        for name in ("n", "sx", "sy", "sxx", "sxy"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def slope(self) -> float | None:
        """Seconds per prompt position; None until forwards of different sizes were seen."""
        spread = self.n * self.sxx - self.sx * self.sx
        if self.n < 3 or spread <= 1e-9 * max(self.sxx, 1.0) * self.n:
            return None
        slope = (self.n * self.sxy - self.sx * self.sy) / spread
        return slope if slope > 0 else None


def _per_row(value: int | Sequence[int], batch_size: int, name: str) -> list[int]:
    """Per-row counts; a bare int is accepted for a batch of one."""
    rows = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    if len(rows) != batch_size:
        raise ValueError(f"{name} has {len(rows)} rows, batch_size is {batch_size}")
    return rows


@dataclass
class EngineStats:
    """Counters the engine updates once per decode step; `summary()` is what gets reported.

    Two levels, both reported (docs/sd-statistics.md): engine passes (a plain pass or a verify
    pass over the whole batch: what costs time) and row steps (one sequence in one pass: what
    a sample experiences). A row without a draft in a verify pass is a plain row step, so
    `sd_step_share` counts only rows that really verified drafts. Accepted length follows the
    EAGLE/TLT convention: accepted drafts + 1 per row step with a draft (plain decoding is 1).
    The first token of every sample comes from the prefill (`first_tokens`), never from a
    decode step.
    """

    plain_steps: int = 0  # plain passes
    plain_rows: int = 0  # rows in them (one token each)
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    first_tokens: int = 0  # samples' first tokens, drawn from the prefill's last position
    spec: dict[str, _SpecTotals] = field(default_factory=dict)
    # accepted drafts + 1 per row step with a draft -> how many times
    accepted_length_hist: Counter[int] = field(default_factory=Counter)
    other_seconds: Counter[str] = field(default_factory=Counter)  # prefill, drafter training...
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)
    # Per drafter (a history step drafts some rows with EAGLE): rows that verified its drafts
    # and drafts of it accepted.
    drafter_rows: Counter[str] = field(default_factory=Counter)
    drafter_accepted: Counter[str] = field(default_factory=Counter)
    # A recorder's list (a rollout trace), None when nothing records: one entry per decode
    # pass, ("plain", rows) or (strategy, drafted, accepted, emitted, drafters) per row.
    step_log: list[tuple] | None = None

    def record_plain_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """One ordinary decode pass over batch_size sequences producing `tokens` tokens."""
        self.plain_steps += 1
        self.plain_rows += batch_size
        self.plain_tokens += tokens
        self.plain_seconds += seconds
        if self.step_log is not None:
            self.step_log.append(("plain", batch_size))

    def record_spec_step(
        self,
        batch_size: int,
        strategy: Strategy | str,
        drafted: int | Sequence[int],
        accepted: int | Sequence[int],
        emitted: int | Sequence[int],
        draft_seconds: float,
        verify_seconds: float,
        drafters: Sequence[str] | None = None,
    ) -> None:
        """One draft+verify pass over batch_size sequences, with per-row counts.
        `drafters`: which drafter proposed each row (default: the strategy's).

        drafted[i]: drafts verified for row i (0: it decoded plainly in this pass);
        accepted[i]: how many of them it kept (at most the tokens it emitted); emitted[i]:
        tokens it gained. A row with drafts that emitted more than it accepted drew one
        token itself: a bonus token when every draft was kept, else a residual token (a
        stop token among the accepted drafts ends the row before that draw).
        """
        d_rows = _per_row(drafted, batch_size, "drafted")
        a_rows = _per_row(accepted, batch_size, "accepted")
        e_rows = _per_row(emitted, batch_size, "emitted")
        step = _SpecTotals(
            steps=1,
            rows=batch_size,
            emitted=sum(e_rows),
            seconds=draft_seconds + verify_seconds,
        )
        name = strategy.name if isinstance(strategy, Strategy) else str(strategy)
        kinds = drafters or [name.split("/")[0]] * batch_size
        for d, a, e, kind in zip(d_rows, a_rows, e_rows, kinds, strict=True):
            if d == 0:
                continue
            self.drafter_rows[kind] += 1
            self.drafter_accepted[kind] += a
            step.draft_rows += 1
            step.drafted += d
            step.accepted += a
            if e > a:
                if a == d:
                    step.bonus += 1
                else:
                    step.residual += 1
            self.accepted_length_hist[a + 1] += 1
        self.spec.setdefault(name, _SpecTotals()).add(step)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        if self.step_log is not None:
            self.step_log.append((name, d_rows, a_rows, e_rows, list(kinds)))

    def record_phase(self, phase: str, seconds: float) -> None:
        """Time spent outside decode steps (e.g. "prefill", "drafter_train")."""
        self.other_seconds[phase] += seconds

    def record_prefill(self, positions: int, seconds: float) -> None:
        """One prefill forward: `positions` computed (rows x width), in `seconds`."""
        self.record_phase("prefill", seconds)
        self.prefill_fit.add(positions, seconds)

    @property
    def spec_totals(self) -> _SpecTotals:
        out = _SpecTotals()
        for t in self.spec.values():
            out.add(t)
        return out

    def summary(self) -> dict[str, object]:
        """A JSON-able digest: passes and row steps per mode, tokens by source, tokens/s per
        pass kind, accepted length, phases (docs/sd-statistics.md defines every key)."""
        sd = self.spec_totals
        passes = self.plain_steps + sd.steps
        pass_tokens = self.plain_tokens + sd.emitted
        decode_seconds = self.plain_seconds + sd.seconds
        # Row steps without a draft: every row of a plain pass, and the verify-pass rows that
        # had nothing to verify (each gained exactly one token).
        plain_rows = self.plain_rows + sd.rows - sd.draft_rows
        row_steps = plain_rows + sd.draft_rows
        by_source = {
            "first": self.first_tokens,
            "plain": plain_rows,
            "accepted": sd.accepted,
            "residual": sd.residual,
            "bonus": sd.bonus,
        }
        return {
            "steps": {"plain": self.plain_steps, "spec": sd.steps, "total": passes},
            "verify_pass_share": _ratio(sd.steps, passes),
            "row_steps": {"draft": sd.draft_rows, "plain": plain_rows, "total": row_steps},
            "sd_step_share": _ratio(sd.draft_rows, row_steps),
            "tokens": by_source | {"total": sum(by_source.values())},
            "drafted_tokens": sd.drafted,
            "tokens_per_s": {
                "plain": _ratio(self.plain_tokens, self.plain_seconds),
                "spec": _ratio(sd.emitted, sd.seconds),
                "decode": _ratio(pass_tokens, decode_seconds),
            },
            "prefill_seconds_per_token": self.prefill_fit.slope(),
            "mean_batch": {
                "plain": _ratio(self.plain_rows, self.plain_steps),
                "spec": _ratio(sd.rows, sd.steps),
            },
            "mean_accepted_length": _ratio(sd.accepted + sd.draft_rows, sd.draft_rows),
            "acceptance_rate": _ratio(sd.accepted, sd.drafted),
            "accepted_length_hist": dict(sorted(self.accepted_length_hist.items())),
            "seconds": {
                "plain_decode": self.plain_seconds,
                "draft": self.draft_seconds,
                "verify": self.verify_seconds,
                **dict(sorted(self.other_seconds.items())),
            },
            "per_strategy": {name: t.as_dict() for name, t in sorted(self.spec.items())},
            "per_drafter": {
                d: {
                    "draft_rows": rows,
                    "accepted": self.drafter_accepted[d],
                    "mean_accepted_length": _ratio(self.drafter_accepted[d] + rows, rows),
                }
                for d, rows in sorted(self.drafter_rows.items())
            },
        }

    def merge(self, other: EngineStats) -> None:
        """Add another engine's (or another period's) counters into this one."""
        self.plain_steps += other.plain_steps
        self.plain_rows += other.plain_rows
        self.plain_tokens += other.plain_tokens
        self.plain_seconds += other.plain_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.first_tokens += other.first_tokens
        for name, t in other.spec.items():
            self.spec.setdefault(name, _SpecTotals()).add(t)
        self.accepted_length_hist.update(other.accepted_length_hist)
        self.other_seconds.update(other.other_seconds)
        self.prefill_fit.merge(other.prefill_fit)
        self.drafter_rows.update(other.drafter_rows)
        self.drafter_accepted.update(other.drafter_accepted)

    def reset(self) -> None:
        """Zero every counter (e.g. after a stats report); a recorder's step_log stays."""
        fresh = EngineStats(step_log=self.step_log)
        self.__dict__.update(fresh.__dict__)
