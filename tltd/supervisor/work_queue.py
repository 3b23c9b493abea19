"""In-memory bookkeeping of live rollout requests: which samples wait, which worker runs which.

Pure data structure (no I/O, no asyncio, no clock): the supervisor owns one and calls it from
the event loop only. Every sample of a live request is in exactly one place: pending (waiting
for a worker), running (on a worker) or finished (stored: complete, partial, cancelled or
failed). A request is live here for the prompts (work units) this node claimed; a unit is
complete when every one of its samples is finished.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import KeysView
from dataclasses import dataclass, field

from tltd.contract.lengths import predicted_left
from tltd.contract.rollout_messages import AddWork
from tltd.domain import (
    RequestStatus,
    RolloutRequest,
    Sample,
    SpeculativeMode,
    prompt_share_key,
    turn_of,
    turn_session_id,
)
from tltd.scheduler import PendingWork
from tltd.supervisor.session_pins import SessionPins

Key = tuple[int, int]  # (prompt_index, sample_index)


@dataclass
class RequestLedger:
    """One live request's entry in the work queue: where each of its samples is (the streams,
    the stores and the retries around it are `tltd.supervisor.live_requests.LiveRequests`)."""

    req: RolloutRequest
    policy_version: int  # every sample runs on this version (see `tltd.supervisor.model_planner`)
    enqueued_at: float
    pending: dict[int, list[int]]  # prompt index -> sample indices waiting for a worker
    # The units claimed by this node: prompt index -> which of its claims made the unit live
    # (a unit lost and claimed again is a new claim: `WorkQueue.claim_of`).
    claims: dict[int, int] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)  # units this node recorded done since
    running: dict[Key, str] = field(default_factory=dict)  # -> worker id
    finished: set[Key] = field(default_factory=set)
    failed: int = 0  # finished with FinishReason.FAILED
    first_error: str = ""
    attempts: Counter[Key] = field(default_factory=Counter)  # workers lost while running it
    started: bool = False  # some sample was handed to a worker (request -> RUNNING)
    start_written: bool = False  # a unit's end recorded here found it RUNNING (or ended)
    outcome: RequestStatus | None = None  # CANCELLED / FAILED once decided: run nothing more
    reason: str = ""
    # prompt index -> the job's earlier answers to that prompt, read from the store when the
    # unit was claimed: ((request id, prompt index, sample index), token ids), oldest first.
    history: dict[int, tuple[tuple[tuple[str, int, int], tuple[int, ...]], ...]] = field(
        default_factory=dict
    )
    # Samples stored unfinished by a node that handed them over (a drain): where a worker goes
    # on from, instead of running them again from their seed.
    resume: dict[Key, Sample] = field(default_factory=dict)
    # Its step bound was reached and it parks (`tltd.supervisor.parking`): nothing more of it
    # is handed out; what runs comes back paused.
    parking: bool = False
    paused: set[Key] = field(default_factory=set)  # came back paused by the step's token budget

    @property
    def units(self) -> KeysView[int]:
        """Prompt indices claimed by this node."""
        return self.claims.keys()

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def job_id(self) -> str:
        return self.req.job_id

    @property
    def done(self) -> bool:
        """Every sample of every unit held here is finished."""
        return all(self.unit_complete(p) for p in self.units)

    def work(self, seq: int, prompt_index: int, indices: list[int]) -> AddWork:
        """What a worker is sent to run these samples of a prompt: with the prompt's earlier
        answers (history drafts) and the stored tokens of those to go on from."""
        req = self.req
        keys = [(prompt_index, i) for i in indices]
        return AddWork(
            seq,
            req.request_id,
            prompt_index,
            tuple(indices),
            req.prompts[prompt_index],
            req.sampling,
            speculative=req.speculative is not SpeculativeMode.OFF,
            history=self.history.get(prompt_index, ()),
            resume=tuple(self.resume[k] for k in keys if k in self.resume),
            pause_after=req.bound_tokens,
            cache_key=self.cache_key,
            share_key=self.share_key,
        )

    @property
    def cache_key(self) -> str:
        """A session turn's key under which its worker keeps the KV for the next turn ("" for
        another request)."""
        return turn_session_id(self.request_id) if self.req.sampling.n == 1 else ""

    @functools.cached_property
    def share_key(self) -> str:
        """A session's first turn's prompt key: the sessions of one prompt (a group) share its
        prefill on one worker ("" for another request)."""
        turn = turn_of(self.request_id)
        if turn is None or turn[1] != 0 or self.req.sampling.n != 1:
            return ""
        return prompt_share_key(self.job_id, self.req.prompts[0])

    def predicted_tokens(self, prompt_index: int) -> int | None:
        """Predicted tokens per sample of a prompt: its earlier answers' mean length; without
        any, the mean over the earlier answers of this request's other prompts (the job's
        prior); None without either. At most max_new_tokens."""
        # The engine predicts with the same rule (`predicted_left`) for the load it reports,
        # from its own history drafter; here it is before any worker runs the prompt.
        answers = self.history.get(prompt_index) or [a for h in self.history.values() for a in h]
        mean = sum(len(t) for _, t in answers) / len(answers) if answers else None
        return predicted_left(mean, self.req.sampling.max_new_tokens)

    def unit_complete(self, prompt_index: int) -> bool:
        return all((prompt_index, s) in self.finished for s in range(self.req.sampling.n))

    def complete_units(self) -> list[int]:
        return sorted(p for p in self.units if self.unit_complete(p))

    def pending_keys(self) -> list[Key]:
        return [(p, s) for p, idx in sorted(self.pending.items()) for s in idx]


class WorkQueue:
    def __init__(self) -> None:
        self._live: dict[str, RequestLedger] = {}
        self._by_worker: dict[str, set[tuple[str, Key]]] = {}
        self._claims = itertools.count(1)
        # Session key -> the worker that ran its last turn (and so holds its KV).
        self.pins = SessionPins()
        self.turns_handed_out = 0  # session turns' samples given to workers (a round robin's place)

    def __len__(self) -> int:
        return len(self._live)

    @property
    def holders(self) -> dict[str, str]:
        """Session key -> the worker holding its KV, for the sessions pinned now."""
        return self.pins.holders()

    def __iter__(self):
        return iter(list(self._live.values()))

    def get(self, request_id: str) -> RequestLedger | None:
        return self._live.get(request_id)

    def claim_of(self, request_id: str, prompt_index: int) -> int | None:
        """Which claim made the unit live here (a unit lost and claimed again is a new one);
        None when it is not live."""
        live = self._live.get(request_id)
        return None if live is None else live.claims.get(prompt_index)

    def add(
        self,
        req: RolloutRequest,
        policy_version: int,
        finished: set[Key],
        now: float,
        units: set[int] | None = None,
    ) -> tuple[RequestLedger, bool]:
        """Make the prompts `units` (default: all) of a request live, every sample of them not
        in `finished` pending; True when the request was not live. A unit already live is
        left as it is."""
        live = self._live.get(req.request_id)
        created = live is None
        if live is None:
            live = RequestLedger(req, policy_version, now, {})
            self._live[req.request_id] = live
        for p in sorted(set(range(len(req.prompts))) if units is None else units):
            if p in live.units:
                continue
            live.claims[p] = next(self._claims)
            done = {(p, s) for s in range(req.sampling.n) if (p, s) in finished}
            live.finished |= done
            todo = [s for s in range(req.sampling.n) if (p, s) not in done]
            if todo:
                live.pending[p] = todo
        return live, created

    def drop_unit(self, request_id: str, prompt_index: int, recorded: bool = False) -> list[str]:
        """Forget a unit (finished and `recorded` done here, or its lease lost); the request
        goes when it has no unit left. Returns the workers still running samples of it."""
        live = self._live.get(request_id)
        if live is None or prompt_index not in live.units:
            return []
        del live.claims[prompt_index]
        if recorded:
            live.recorded.add(prompt_index)
        live.pending.pop(prompt_index, None)
        workers = []
        for key in [k for k in live.running if k[0] == prompt_index]:
            wid = live.running.pop(key)
            self._by_worker.get(wid, set()).discard((request_id, key))
            workers.append(wid)
        live.finished = {k for k in live.finished if k[0] != prompt_index}
        if not live.units:
            self.remove(request_id)
        return sorted(set(workers))

    def remove(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            for key, wid in live.running.items():
                self._by_worker.get(wid, set()).discard((request_id, key))

    def waiting(self) -> bool:
        """Some sample waits for a worker."""
        return any(idx for live in self._live.values() for idx in live.pending.values())

    def pending_work(self) -> list[PendingWork]:
        """One entry per prompt with waiting samples, for the scheduler's snapshot."""
        return [
            PendingWork(
                live.request_id,
                p,
                live.job_id,
                len(idx),
                live.req.sampling.max_new_tokens,
                live.enqueued_at,
                live.policy_version,
                live.predicted_tokens(p),
                live.cache_key,
                live.share_key,
                len(live.req.prompts[p]),
            )
            for live in self._live.values()
            if live.outcome is None and not live.parking
            for p, idx in sorted(live.pending.items())
        ]

    def take(self, request_id: str, prompt_index: int, count: int, worker_id: str) -> list[int]:
        """Move up to `count` pending samples of a prompt to `worker_id`; returns their indices."""
        live = self._live.get(request_id)
        if live is None or live.outcome is not None or live.parking:
            return []
        idx = live.pending.get(prompt_index, [])
        taken, rest = idx[:count], idx[count:]
        if rest:
            live.pending[prompt_index] = rest
        else:
            live.pending.pop(prompt_index, None)
        slot = self._by_worker.setdefault(worker_id, set())
        for s in taken:
            live.running[(prompt_index, s)] = worker_id
            slot.add((request_id, (prompt_index, s)))
        if live.cache_key:
            self.turns_handed_out += len(taken)
        if live.share_key and taken:
            self.pins.shared(live.share_key, worker_id)
        return taken

    def finish(
        self, request_id: str, key: Key, failed_error: str | None = None, reused_tokens: int = 0
    ) -> RequestLedger | None:
        """Record a finished sample; None when it is not live or already finished (a duplicate).

        `failed_error` is not None for a sample that finished FAILED; `reused_tokens`: prompt
        positions its worker restored from kept KV.
        """
        live = self._live.get(request_id)
        if live is None or key in live.finished or key[0] not in live.units:
            return None
        wid = live.running.pop(key, None)
        if wid is not None:
            self._by_worker.get(wid, set()).discard((request_id, key))
            if live.cache_key:
                self.pins.held_by(live.cache_key, wid, reused_tokens)
        else:  # finished without running (cancelled or aborted while pending)
            idx = live.pending.get(key[0], [])
            if key[1] in idx:
                idx.remove(key[1])
                if not idx:
                    live.pending.pop(key[0], None)
        live.finished.add(key)
        if failed_error is not None:
            live.failed += 1
            live.first_error = live.first_error or failed_error
        return live

    def paused(self, request_id: str, key: Key) -> bool:
        """A running sample came back paused (its request parks): it is no longer running,
        and not finished here. False when it was not running."""
        live = self._live.get(request_id)
        if live is None or key not in live.running:
            return False
        wid = live.running.pop(key)
        self._by_worker.get(wid, set()).discard((request_id, key))
        return True

    def running_on(self, worker_id: str) -> list[tuple[RequestLedger, Key]]:
        return [
            (self._live[rid], key)
            for rid, key in sorted(self._by_worker.get(worker_id, ()))
            if rid in self._live
        ]

    def inflight(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def lose_worker(self, worker_id: str, max_attempts: int) -> list[tuple[RequestLedger, Key]]:
        """A worker died: its samples go back to pending (retried), except those of requests
        that are closing or that exhausted `max_attempts`: those are returned, for the caller
        to finish (cancelled / aborted / failed)."""
        give_up: list[tuple[RequestLedger, Key]] = []
        for live, key in self.running_on(worker_id):
            del live.running[key]
            live.attempts[key] += 1
            if live.outcome is not None or live.attempts[key] >= max_attempts:
                give_up.append((live, key))
                continue
            idx = live.pending.setdefault(key[0], [])
            idx.append(key[1])
            idx.sort()
        self._by_worker.pop(worker_id, None)
        self.pins.lose_worker(worker_id)  # its engine and the KV it kept are gone
        return give_up

    def requeue(self, request_id: str, key: Key, max_attempts: int) -> bool:
        """Put one running sample back to pending (an attempt lost); True when it has used up
        `max_attempts` (or its request is closing): then the caller finishes it instead."""
        live = self._live.get(request_id)
        if live is None or key not in live.running:
            return False
        wid = live.running.pop(key)
        self._by_worker.get(wid, set()).discard((request_id, key))
        live.attempts[key] += 1
        if live.outcome is not None or live.attempts[key] >= max_attempts:
            return True
        idx = live.pending.setdefault(key[0], [])
        idx.append(key[1])
        idx.sort()
        return False

    def close(self, request_id: str, outcome: RequestStatus, reason: str) -> list[Key]:
        """Stop a request (cancel / fail): nothing more is handed out; returns its pending
        samples, which the caller finishes itself. Running ones finish on their workers."""
        live = self._live.get(request_id)
        if live is None:
            return []
        if live.outcome is None:
            live.outcome, live.reason = outcome, reason
        # Pending samples stay unfinished until the caller reports them through finish().
        return live.pending_keys()
