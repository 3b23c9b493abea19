"""Trainer stand-ins for the reliability tests: threads that keep rollout requests in flight
against a daemon and record, per request id, when it was sent, its first and last sample, and
how it ended, so a test can check that nothing was lost; and a sampler of which job holds each
rollout worker (device-seconds per job)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import grpc

from tltd.v1 import rollout_pb2
from tltd_clients.client import TltClient
from tltd_clients.errors import NotFoundError, TltClientError


@dataclass
class Outcome:
    request_id: str
    job_id: str
    expected: int  # samples it asked for
    sent_wall: float  # time.time() when sent (compared with the store's created_at)
    sent: float  # time.monotonic()
    first_sample: float | None = None
    done: float | None = None
    samples: set = field(default_factory=set)  # (prompt_index, sample_index)
    error: str = ""  # "CODE: message" of the final failure ("" = completed)
    retried: list = field(default_factory=list)  # errors of attempts that were retried
    prompts: list = field(default_factory=list)  # what was sent, for a retry by hand
    sampling: rollout_pb2.SamplingParams | None = None


class Trainer:
    """`inflight` threads, each sending one request at a time to `job_id` until stopped;
    a stream that breaks (daemon restart, network) is retried with the same request id, as
    the client library does, until it completes or the daemon gives a final answer."""

    def __init__(
        self,
        target: str,
        job_id: str,
        *,
        inflight: int,
        prompts: int = 2,
        n: int = 4,
        max_new_tokens: int = 24,
        retry_seconds: float = 120.0,
        name: str = "",
    ) -> None:
        self.target, self.job_id, self.inflight = target, job_id, inflight
        self.name = name or job_id  # request ids are "<name>-00001", ...
        self.prompts, self.n, self.max_new_tokens = prompts, n, max_new_tokens
        self.retry_seconds = retry_seconds
        self.outcomes: dict[str, Outcome] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seq = 0

    def start(self) -> Trainer:
        for i in range(self.inflight):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop_sending(self) -> None:
        """No new requests (those in flight go on)."""
        self._stop.set()

    def stop(self, timeout: float = 300.0) -> None:
        """No new requests; wait for those in flight to end."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), f"{self.job_id}: requests hang"

    def outstanding(self) -> int:
        """Samples asked for and not yet received (what the job still has to run, as the
        trainer sees it; includes requests still being admitted)."""
        with self._lock:
            running = [o for o in self.outcomes.values() if o.done is None]
        return sum(o.expected - len(o.samples) for o in running)

    def _next_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self.name}-{self._seq:05d}"

    def _loop(self, lane: int) -> None:
        rng = random.Random(f"{self.name}/{lane}")
        with TltClient(self.target, timeout=120) as client:
            while not self._stop.is_set():
                self.run_one(client, rng)

    def run_one(self, client: TltClient, rng: random.Random) -> Outcome:
        rid = self._next_id()
        prompts = [[rng.randrange(1, 48) for _ in range(rng.randint(3, 12))]
                   for _ in range(self.prompts)]  # fmt: skip
        sampling = rollout_pb2.SamplingParams(
            n=self.n, max_new_tokens=self.max_new_tokens, temperature=1.0, seed=rng.getrandbits(64)
        )
        out = Outcome(rid, self.job_id, self.prompts * self.n, time.time(), time.monotonic())
        out.prompts, out.sampling = prompts, sampling
        with self._lock:
            self.outcomes[rid] = out
        return self._send(client, out)

    def send(
        self, client: TltClient, prompts: list[list[int]], sampling: rollout_pb2.SamplingParams
    ) -> Outcome:
        """One request of the caller's own (prompts, sampling), recorded and retried like the
        others."""
        rid = self._next_id()
        expected = len(prompts) * sampling.n
        out = Outcome(rid, self.job_id, expected, time.time(), time.monotonic())
        out.prompts, out.sampling = prompts, sampling
        with self._lock:
            self.outcomes[rid] = out
        return self._send(client, out)

    def resend(self, client: TltClient, earlier: Outcome, patience: float = 10.0) -> Outcome:
        """The same request (id, prompts, sampling) sent again, as a trainer retries one that
        ended in an error, retrying for `patience` seconds; a fresh outcome (not recorded in
        `outcomes`)."""
        out = Outcome(earlier.request_id, self.job_id, earlier.expected, time.time(),
                      time.monotonic(), prompts=earlier.prompts,
                      sampling=earlier.sampling)  # fmt: skip
        return self._send(client, out, patience)

    def _send(self, client: TltClient, out: Outcome, patience: float | None = None) -> Outcome:
        prompts, sampling, rid = out.prompts, out.sampling, out.request_id
        deadline = time.monotonic() + (self.retry_seconds if patience is None else patience)
        while True:
            try:
                for s in client.generate(self.job_id, prompts, sampling=sampling, request_id=rid):
                    if out.first_sample is None:
                        out.first_sample = time.monotonic()
                    out.samples.add((s.prompt_index, s.sample_index))
                out.done = time.monotonic()
                return out
            except TltClientError as exc:
                why = f"{exc.code.name}: {exc.message}"
                retry = exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
                if not retry or time.monotonic() > deadline:
                    out.error, out.done = why, time.monotonic()
                    return out
                out.retried.append(why)
                time.sleep(0.2)


class WorkerSampler:
    """Samples ListWorkers every `period` seconds: seconds each job held a rollout worker (a
    worker counts for the job whose model it last loaded, also while it drains or loads the
    next one), and, given the trainers, seconds each job had more samples outstanding than its
    workers hold (`per_worker` each): was backlogged, as the trainer sees it."""

    def __init__(
        self,
        target: str,
        period: float = 0.1,
        trainers: dict[str, Trainer] | None = None,
        per_worker: int = 0,
    ) -> None:
        self.target, self.period = target, period
        self.trainers, self.per_worker = trainers if trainers is not None else {}, per_worker
        self.held: dict[str, float] = defaultdict(float)
        self.backlogged: dict[str, float] = defaultdict(float)
        self.measured = 0.0  # seconds sampled while measuring
        self.timeline: list[tuple[float, tuple[str, ...]]] = []  # (time, job of each worker)
        self.measuring = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> WorkerSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with TltClient(self.target, timeout=120) as client:
            last = time.monotonic()
            while not self._stop.wait(self.period):
                now = time.monotonic()
                dt, last = now - last, now
                workers = [w for w in client.list_workers() if w.kind == "rollout"]
                held = [w.job_id if w.state in ("ready", "busy") else "" for w in workers]
                if self.timeline == [] or self.timeline[-1][1] != tuple(held):
                    self.timeline.append((now, tuple(held)))
                if not self.measuring.is_set():
                    continue
                self.measured += dt
                for job in held:
                    if job:
                        self.held[job] += dt
                for job, trainer in list(self.trainers.items()):
                    if trainer.outstanding() > self.per_worker * held.count(job):
                        self.backlogged[job] += dt


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


@dataclass
class Accounting:
    """What became of every request a trainer sent, checked against the store by request id."""

    outcomes: list[Outcome]
    stored: dict[str, rollout_pb2.RolloutRequest]  # requests whose Generate ended without error
    errored: dict[str, rollout_pb2.RolloutRequest | None]  # None: never stored
    resent: dict[str, Outcome]  # each errored request sent again with the same id
    after: dict[str, rollout_pb2.RolloutRequest]  # stored state of those that then completed

    @property
    def complete(self) -> list[Outcome]:
        return [o for o in self.outcomes if len(o.samples) == o.expected and not o.error]

    @property
    def incomplete(self) -> list[Outcome]:
        return [o for o in self.outcomes if len(o.samples) != o.expected or o.error]

    def figures(self) -> dict:
        return {
            "requests": len(self.outcomes),
            "samples": sum(len(o.samples) for o in self.outcomes),
            "completed": len(self.complete),
            "incomplete": len(self.incomplete),
            "incomplete_never_stored": sum(1 for r in self.errored.values() if r is None),
            "incomplete_completed_when_sent_again": sum(
                1 for o in self.resent.values() if not o.error and len(o.samples) == o.expected
            ),
            "final_client_errors": dict(Counter(o.error.split(":")[0] for o in self.incomplete)),
            "retried_client_errors": sorted(
                {e.split(":")[0] for o in self.outcomes for e in o.retried}
            ),
        }

    def check_nothing_lost(self) -> None:
        """Every request completed with each sample once (client and store agree), or its
        trainer was told an error (never INTERNAL) and the request was never stored (then,
        sent again with the same id, it completes) or ended FAILED with a reason."""
        for o in self.complete:  # a set of (prompt, sample): a duplicate is not counted twice
            r = self.stored[o.request_id]
            assert r.status == rollout_pb2.REQUEST_STATUS_COMPLETED, (o.request_id, r)
            assert r.samples_done == o.expected, (o.request_id, r)
        for o in self.incomplete:
            assert o.error, f"{o.request_id}: the stream ended short without an error: {o}"
            # A fault of the database or a worker is the trainer's to retry, not a daemon bug.
            assert not o.error.startswith(("INTERNAL", "UNKNOWN")), o
            # A request running on while its trainer was told it failed would be work the
            # trainer does not know of.
            r = self.errored[o.request_id]
            failed = r is not None and r.status == rollout_pb2.REQUEST_STATUS_FAILED
            assert r is None or (failed and r.status_reason), (o, r)
            again = self.resent[o.request_id]
            if r is None:
                assert not again.error and len(again.samples) == o.expected, again
                assert self.after[o.request_id].status == rollout_pb2.REQUEST_STATUS_COMPLETED
                assert self.after[o.request_id].samples_done == o.expected
            else:
                assert again.error, again  # a failed request says so again


def account(client: TltClient, trainer: Trainer) -> Accounting:
    """Look every request of `trainer` up (after `trainer.stop()`). A request whose Generate
    ended in an error may never have been stored (its admission met the fault): looked up
    apart, then sent again with the same id, as a trainer retries."""
    outcomes = list(trainer.outcomes.values())
    stored = {o.request_id: client.get_request(o.request_id).request
              for o in outcomes if not o.error}  # fmt: skip
    errored = {o.request_id: _lookup(client, o.request_id) for o in outcomes if o.error}
    resent = {rid: trainer.resend(client, trainer.outcomes[rid]) for rid in errored}
    after = {rid: client.get_request(rid).request for rid, o in resent.items() if not o.error}
    return Accounting(outcomes, stored, errored, resent, after)


def _lookup(client: TltClient, request_id: str) -> rollout_pb2.RolloutRequest | None:
    """The stored request, or None when the daemon never stored it."""
    try:
        return client.get_request(request_id).request
    except NotFoundError:
        return None
