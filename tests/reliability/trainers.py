"""Trainer stand-ins for the reliability tests: threads that keep rollout requests in flight
against a daemon and record, per request id, when it was sent, its first and last sample, and
how it ended, so a test can check that nothing was lost; and a sampler of which job holds each
rollout worker (device-seconds per job)."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc

from clients.client import TltClient
from clients.errors import TltClientError
from tltd.v1 import rollout_pb2


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
    ) -> None:
        self.target, self.job_id, self.inflight = target, job_id, inflight
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

    def stop(self, timeout: float = 300.0) -> None:
        """No new requests; wait for those in flight to end."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), f"{self.job_id}: requests hang"

    def _next_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self.job_id}-{self._seq:05d}"

    def _loop(self, lane: int) -> None:
        rng = random.Random(f"{self.job_id}/{lane}")
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
        with self._lock:
            self.outcomes[rid] = out
        deadline = time.monotonic() + self.retry_seconds
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
    """Samples ListWorkers every `period` seconds: seconds each job held a rollout worker."""

    def __init__(self, target: str, period: float = 0.1) -> None:
        self.target, self.period = target, period
        self.held: dict[str, float] = defaultdict(float)
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
                if self.measuring.is_set():
                    for job in held:
                        if job:
                            self.held[job] += dt


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]
