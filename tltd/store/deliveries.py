"""Groups sent by bounded requests (asynchronous RL): which request's stream sent each whole
group, each once, and which were too stale to send.

A bounded request's stream (`GenerateRequest.bound`) takes whole groups (a prompt's unit, done,
with all its samples stored) one transaction at a time: its own and, with `carried`, those its
job's other bounded requests left unsent. Taking a group writes its unit's `delivered_to`
(conditional on it being NULL), so two streams never send the same group, and a retry of the
request re-sends exactly the groups recorded for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy import and_, case, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from tltd.domain import BoundedStats, Sample
from tltd.errors import NotFound
from tltd.store import convert
from tltd.store.database import BINARY_RESULTS, Database
from tltd.store.leases import DONE, FAILED, LEASED, PARKED, QUEUED
from tltd.store.tables import JobRow, RolloutRequestRow, SampleRow, WorkUnitRow, utcnow

STALE = ""  # delivered_to of a group dropped as too stale to send


@dataclass(frozen=True)
class SentGroup:
    """One prompt's group as a bounded stream sends it, and how stale it was then: the job's
    policy version less the oldest version any of its tokens came from."""

    request_id: str
    prompt_index: int
    samples: tuple[Sample, ...]
    staleness: int
    carried: bool  # from an earlier request than the stream's own


@dataclass(frozen=True)
class Delivery:
    """What one take gave a bounded stream: the groups taken now, those dropped as too stale,
    and the units that may still give it groups later (its own, and carried ones)."""

    groups: tuple[SentGroup, ...]
    stale: tuple[SentGroup, ...]
    own_open: int
    carried_open: int

    @property
    def more_may_come(self) -> bool:
        return bool(self.own_open or self.carried_open)


def version_spread(sample: Sample) -> int:
    """The versions a sample's tokens span, less 1 (0: one version)."""
    return _spread([list(x) for x in sample.policy_spans], sample.policy_version)


def oldest_version(sample: Sample) -> int:
    """The oldest policy version that produced any of the sample's tokens."""
    if sample.policy_spans:
        return min(v for _, v in sample.policy_spans)
    return sample.policy_version


class GroupDeliveries:
    """The groups bounded requests send, and what they may still send."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def take_groups(self, request_id: str, limit: int, carried: bool) -> Delivery:
        """Take up to `limit` whole groups for the stream of `request_id`: with `carried`,
        first those left over by the job's other bounded requests (oldest request first),
        then its own (by prompt). A group with a token more than the job's `max_staleness`
        versions older than its current version is dropped instead (recorded, never sent)."""
        with self.db.tx() as s:
            rr = s.get(RolloutRequestRow, request_id)
            if rr is None:
                raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
            job = s.get(JobRow, rr.job_id)
            assert job is not None  # a request's job is deleted with it
            units = self._done_units(s, rr, carried, max(0, limit))
            taken, stale, unread = self._sort_by_staleness(s, units, rr, job, limit)
            marks = [(g, request_id) for g in taken] + [(g, STALE) for g in stale]
            # In key order, the order a lease renewal locks units in (two orders deadlock);
            # a group another stream took meanwhile is not this one's.
            lost = {
                (g.request_id, g.prompt_index)
                for g, to in sorted(marks, key=lambda m: (m[0].request_id, m[0].prompt_index))
                if not self._mark(s, g, to)
            }
            taken = [g for g in taken if (g.request_id, g.prompt_index) not in lost]
            own_open, carried_open = self._open_counts(s, rr, carried)
            return Delivery(tuple(taken), tuple(stale), own_open + unread, carried_open)

    def bounded_prompts(self, job_id: str) -> int:
        """Prompts (units) of the job's bounded requests so far: what the staleness bound's
        admission rule counts (`tltd.services.bounded.staleness_allows`)."""
        wu, req = WorkUnitRow, RolloutRequestRow
        with self.db.tx(write=False) as s:
            return int(
                s.scalar(
                    select(func.count())
                    .select_from(wu)
                    .join(req, req.request_id == wu.request_id)
                    .where(req.job_id == job_id, req.bound_groups > 0)
                )
                or 0
            )

    def bounded_stats(self, job_id: str) -> BoundedStats | None:
        """How the job's bounded requests went (None: it has none): groups sent and dropped,
        prompts parked and open, and how many sent samples span more than one version."""
        wu, rr, sr = WorkUnitRow, RolloutRequestRow, SampleRow
        bounded = wu.request_id.in_(
            select(rr.request_id).where(rr.job_id == job_id, rr.bound_groups > 0)
        )
        with self.db.tx(write=False) as s:
            counts = dict(
                s.execute(
                    select(
                        case(
                            (wu.delivered_to == STALE, "stale"),
                            (wu.delivered_to.is_not(None), "sent"),
                            (wu.state == PARKED, "parked"),
                            (wu.state.in_((QUEUED, LEASED)), "open"),
                            else_="done",
                        ).label("k"),
                        func.count(),
                    )
                    .where(bounded)
                    .group_by("k")
                ).all()
            )
            if not counts:
                return None
            sent = and_(wu.delivered_to.is_not(None), wu.delivered_to != STALE)
            spans = s.execute(
                select(sr.policy_spans, sr.policy_version)
                .join(wu, and_(wu.request_id == sr.request_id, wu.prompt_index == sr.prompt_index))
                .where(bounded, sent)
            ).all()
        spreads = [_spread(r[0], int(r[1])) for r in spans]
        return BoundedStats(
            groups_sent=int(counts.get("sent", 0)),
            groups_dropped_stale=int(counts.get("stale", 0)),
            prompts_parked=int(counts.get("parked", 0)),
            prompts_open=int(counts.get("open", 0)),
            samples_sent=len(spreads),
            samples_multi_version=sum(1 for x in spreads if x > 0),
            max_version_spread=max(spreads, default=0),
        )

    def sent_groups(self, request_id: str) -> list[SentGroup]:
        """The groups recorded as sent by `request_id`'s stream (a retry re-sends them)."""
        wu = WorkUnitRow
        with self.db.tx(write=False) as s:
            rr = s.get(RolloutRequestRow, request_id)
            if rr is None:
                raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
            keys = s.execute(
                select(wu.request_id, wu.prompt_index)
                .where(wu.delivered_to == request_id)
                .order_by(wu.updated_at, wu.request_id, wu.prompt_index)
            ).all()
            job = s.get(JobRow, rr.job_id)
            assert job is not None
            samples = self._samples(s, [(k[0], int(k[1])) for k in keys])
            prompts = self._prompts(s, {k[0] for k in keys} - {request_id})
            return [
                self._group(k[0], int(k[1]), samples, prompts, job.policy_version) for k in keys
            ]

    # ---- parts ------------------------------------------------------------------------------

    def _done_units(
        self, s: Session, rr: RolloutRequestRow, carried: bool, limit: int
    ) -> list[tuple[str, int, int]]:
        """Undelivered units that are done (request, prompt, samples), in the order they are to
        be sent; carried ones only with `carried`. Not locked: `_mark` takes each one
        conditionally."""
        wu, req = WorkUnitRow, RolloutRequestRow
        mine = wu.request_id == rr.request_id
        whose = or_(mine, self._carried_from(rr)) if carried else mine
        q = (
            select(wu.request_id, wu.prompt_index, wu.samples)
            .join(req, req.request_id == wu.request_id)
            .where(whose, wu.delivered_to.is_(None), wu.state.in_((DONE, FAILED)))
            .order_by(case((mine, 1), else_=0), req.created_at, wu.request_id, wu.prompt_index)
        )
        # Stale groups are dropped, not sent: read past the limit to fill it.
        return [(r[0], int(r[1]), int(r[2])) for r in s.execute(q.limit(limit * 4 + 16)).all()]

    @staticmethod
    def _carried_from(rr: RolloutRequestRow) -> object:
        """The units of the job's other bounded requests."""
        req = RolloutRequestRow
        return and_(req.job_id == rr.job_id, req.bound_groups > 0, req.request_id != rr.request_id)

    def _sort_by_staleness(
        self,
        s: Session,
        units: list[tuple[str, int, int]],
        rr: RolloutRequestRow,
        job: JobRow,
        limit: int,
    ) -> tuple[list[SentGroup], list[SentGroup], int]:
        """The first `limit` groups within the job's staleness bound, the stale ones read
        before the limit was reached, and how many units this read did not find whole (left
        for a later take: only a whole group is sent)."""
        samples = self._samples(s, [(r, p) for r, p, _ in units])
        prompts = self._prompts(s, {r for r, _, _ in units} - {rr.request_id})
        taken: list[SentGroup] = []
        stale: list[SentGroup] = []
        unread = 0
        for rid, p, n in units:
            if len(taken) >= limit:
                break
            if len(samples.get((rid, p), ())) < n:
                unread += 1
                continue
            group = self._group(rid, p, samples, prompts, job.policy_version)
            bound = job.max_staleness
            (stale if bound is not None and group.staleness > bound else taken).append(group)
        return taken, stale, unread

    @staticmethod
    def _group(
        rid: str,
        p: int,
        samples: dict[tuple[str, int], list[Sample]],
        prompts: dict[str, list[list[int]]],
        version: int,
    ) -> SentGroup:
        """A unit's group; one of another request (in `prompts`) names its prompt."""
        mine = samples.get((rid, p), [])
        carried = rid in prompts
        if carried:
            prompt = tuple(int(t) for t in prompts[rid][p])
            mine = [replace(x, prompt_token_ids=prompt) for x in mine]
        oldest = min((oldest_version(x) for x in mine), default=version)
        return SentGroup(rid, p, tuple(mine), max(0, version - oldest), carried)

    @staticmethod
    def _samples(
        s: Session, units: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], list[Sample]]:
        """The stored samples of `units`, by unit, in sample order."""
        out: dict[tuple[str, int], list[Sample]] = {}
        if not units:
            return out
        sr = SampleRow
        rows = s.execute(
            select(SampleRow.__table__)
            .where(tuple_(sr.request_id, sr.prompt_index).in_(list(units)))
            .order_by(sr.request_id, sr.prompt_index, sr.sample_index),
            execution_options={BINARY_RESULTS: True},
        ).all()
        for r in rows:
            out.setdefault((r.request_id, int(r.prompt_index)), []).append(
                convert.sample_from_row(r)
            )
        return out

    @staticmethod
    def _prompts(s: Session, request_ids: set[str]) -> dict[str, list[list[int]]]:
        """The prompts of other requests whose groups are sent (a carried group names its
        prompt: the caller may not hold that request any more)."""
        if not request_ids:
            return {}
        req = RolloutRequestRow
        rows = s.execute(
            select(req.request_id, req.prompts).where(req.request_id.in_(sorted(request_ids)))
        ).all()
        return {r[0]: r[1] for r in rows}

    @staticmethod
    def _mark(s: Session, group: SentGroup, to: str) -> bool:
        """Record the group sent to `to` (or dropped); False when it was recorded already."""
        wu = WorkUnitRow
        result = s.execute(
            update(wu)
            .where(
                wu.request_id == group.request_id,
                wu.prompt_index == group.prompt_index,
                wu.delivered_to.is_(None),
            )
            .values(delivered_to=to, updated_at=utcnow())
        )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    def _open_counts(self, s: Session, rr: RolloutRequestRow, carried: bool) -> tuple[int, int]:
        """Units not sent yet that may still be: the request's own, and (with `carried`) the
        job's other bounded requests'. Running, queued, or done since `_done_units` read:
        on PostgreSQL each statement sees what committed before it, so a unit done in
        between is counted here (the stream takes it next) instead of ending the stream
        short. A parked unit comes back only through a carried request's admission."""
        wu, req = WorkUnitRow, RolloutRequestRow
        unsent = and_(wu.delivered_to.is_(None), wu.state != PARKED)
        own = s.scalar(
            select(func.count()).select_from(wu).where(wu.request_id == rr.request_id, unsent)
        )
        other = 0
        if carried:
            other = s.scalar(
                select(func.count())
                .select_from(wu)
                .join(req, req.request_id == wu.request_id)
                .where(self._carried_from(rr), unsent)
            )
        return int(own or 0), int(other or 0)


def _spread(spans: list | None, version: int) -> int:
    """The versions a stored sample's tokens span, less 1 (0: one version)."""
    versions = [int(v) for _, v in spans] if spans else [version]
    return max(versions) - min(versions)
