"""Prometheus metrics: every tltd metric, the small API that updates them, and the endpoint.

Other parts of the daemon call the update methods of the process-wide `METRICS` (or of a
`Metrics` they were given: tests build their own on a private registry)::

    from tltd.metrics import METRICS
    METRICS.record_sample(job_id, sample)     # each finished tltd.domain.Sample, or:
    METRICS.observe_sample(job_id, tokens=..., finish_reason="stop", draft_steps=...,
                           plain_steps=..., accepted_tokens=...)
    METRICS.observe_decode_steps(device_id, plain_steps=..., spec_steps=...,
                                 accepted_lengths={1: 3, 4: 10})   # engine stats deltas
    METRICS.observe_engine_summary(device_id, previous, current)  # EngineStats.summary()s
    #   (and a torch engine's `prefix_cache` counters: prefix cache hits, prefill tokens)
    METRICS.set_queue_depth(job_id, samples_waiting)
    METRICS.set_session_pins(worker_id, sessions)  # open sessions whose KV the worker holds
    METRICS.record_repins(["gone"])                # session turns sent away from their KV
    METRICS.set_device_state(device_id, "rollout" | "idle" | "training" | "unavailable")
    METRICS.set_trainer_loading(device_id, True)  # a TRAINING device whose trainer is loading
    METRICS.set_drafter_version(job_id, version); METRICS.set_policy_version(job_id, version)
    METRICS.record_preemption(device_id, reason="rollout_arrived", latency_seconds=0.12)
    METRICS.record_worker_failure(worker_id, cause="oom_kill" | "exited" | "killed")
    METRICS.forget_job(job_id)   # a finished job's labelled series disappear
    METRICS.observe_admission(seconds)             # a request accepted: validate + store
    METRICS.observe_groups(job_id, staleness=[0, 1], carried=[False, True], stale=0)
    METRICS.observe_sample_writes(seconds, count)  # one transaction storing `count` samples

All methods are thread-safe (prometheus-client's metrics are, and the device-state clock has
its own lock) and cheap enough to call per sample. `start_metrics_server` serves the
exposition over HTTP (`settings.metrics_port`, 0 = off).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tltd.domain import Sample

DEVICE_STATES = ("idle", "rollout", "training", "unavailable")
# Tokens a sequence gains per SD step (accepted drafts + 1): 1 = nothing accepted.
_ACCEPTED_LENGTH_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 10, 12, 16)
# The control plane's own cost: admission and sample writes are expected in milliseconds.
_CONTROL_PLANE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5
)  # fmt: skip
_PREEMPTION_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _DeviceClock(Collector):
    """Seconds each device spent in each state, exact at every scrape.

    A counter bumped on transitions would lag by the whole time of the current state (a long
    training phase would show up only when it ends), so the current state's open interval is
    added at collection time instead.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._closed: dict[tuple[str, str], float] = {}
        self._current: dict[str, tuple[str, float]] = {}  # device -> (state, since)

    def set_state(self, device_id: str, state: str) -> None:
        now = self._clock()
        with self._lock:
            old = self._current.get(device_id)
            if old is not None and old[0] == state:
                return
            if old is not None:
                key = (device_id, old[0])
                self._closed[key] = self._closed.get(key, 0.0) + now - old[1]
            self._current[device_id] = (state, now)

    def seconds(self) -> dict[tuple[str, str], float]:
        now = self._clock()
        with self._lock:
            out = dict(self._closed)
            for device, (state, since) in self._current.items():
                out[(device, state)] = out.get((device, state), 0.0) + now - since
            return out

    def states(self) -> dict[str, str]:
        with self._lock:
            return {d: s for d, (s, _) in self._current.items()}

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        seconds = CounterMetricFamily(
            "tltd_device_state_seconds",
            "Seconds each device spent in each state (rollout, idle, training, unavailable)",
            labels=["device_id", "state"],
        )
        for (device, state), value in sorted(self.seconds().items()):
            seconds.add_metric([device, state], value)
        current = GaugeMetricFamily(
            "tltd_device_state",
            "1 for the state each device is in now, 0 for the others",
            labels=["device_id", "state"],
        )
        for device, state in sorted(self.states().items()):
            for s in dict.fromkeys((*DEVICE_STATES, state)):
                current.add_metric([device, s], 1.0 if s == state else 0.0)
        yield seconds
        yield current


class _TrainerLoadingClock(Collector):
    """Seconds each device spent recorded TRAINING while its trainer process was still starting
    (spawned, loading its target and drafter): device-seconds held for training in which no
    training ran. Exact at every scrape, as the device clock is."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._states = _DeviceClock(clock)

    def set_loading(self, device_id: str, loading: bool) -> None:
        self._states.set_state(device_id, "loading" if loading else "other")

    def seconds(self) -> dict[str, float]:
        return {d: v for (d, s), v in self._states.seconds().items() if s == "loading"}

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "tltd_device_trainer_loading_seconds",
            "Seconds a device recorded training spent waiting for its drafter trainer to load",
            labels=["device_id"],
        )
        for device, value in sorted(self.seconds().items()):
            family.add_metric([device], value)
        yield family


@dataclass
class _SpecTotals:
    draft_steps: int = 0
    plain_steps: int = 0
    accepted_tokens: int = 0


class _SpecRatios(Collector):
    """Per-job SD share of steps and mean accepted length, derived from the sample counters
    (also derivable in PromQL from the counters; these gauges save readers the arithmetic)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, _SpecTotals] = {}

    def add(self, job_id: str, draft_steps: int, plain_steps: int, accepted: int) -> None:
        with self._lock:
            t = self.totals.setdefault(job_id, _SpecTotals())
            t.draft_steps += draft_steps
            t.plain_steps += plain_steps
            t.accepted_tokens += accepted

    def forget(self, job_id: str) -> None:
        with self._lock:
            self.totals.pop(job_id, None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        share = GaugeMetricFamily(
            "tltd_sd_step_share",
            "Share of sample decode steps that used speculative decoding, per job",
            labels=["job_id"],
        )
        length = GaugeMetricFamily(
            "tltd_mean_accepted_length",
            "Tokens gained per speculative step (accepted drafts + 1), per job",
            labels=["job_id"],
        )
        with self._lock:
            items = sorted((j, _SpecTotals(**vars(t))) for j, t in self.totals.items())
        for job, t in items:
            steps = t.draft_steps + t.plain_steps
            if steps:
                share.add_metric([job], t.draft_steps / steps)
            if t.draft_steps:
                length.add_metric([job], (t.accepted_tokens + t.draft_steps) / t.draft_steps)
        yield share
        yield length


@dataclass(frozen=True)
class _SampleSeries:
    """A job's per-sample counter series, looked up once."""

    tokens: Any
    draft_steps: Any
    plain_steps: Any
    accepted_tokens: Any
    simulated: Any
    finished: dict[str, Any] = field(default_factory=dict)  # by finish reason


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` `count` times, as one step: its sum and one bucket (a
    batch's per-sample time for each of its samples). prometheus-client keeps a histogram's
    buckets apart (not cumulative) and its sum as values; without them, one by one."""
    inner = ("_upper_bounds", "_buckets", "_sum", "_raise_if_not_observable")
    if count <= 1 or not all(hasattr(histogram, name) for name in inner):
        for _ in range(count):
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets, strict=True):
        if value <= bound:
            bucket.inc(count)
            break


@dataclass(frozen=True)
class _Declared:
    """One metric's declaration: its kind, name, help text, labels and (histograms) buckets."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def build(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        return self.kind(self.name, self.help, self.labels, registry=registry, **extra)


# Every tltd metric with its help text: attribute -> declaration (`Metrics` builds them).
_DECLARED: dict[str, _Declared] = {
    "tokens": _Declared(
        Counter,
        "tltd_rollout_tokens",
        "Output tokens of finished samples (rate() = rollout tokens/s)",
        ("job_id",),
    ),
    "samples": _Declared(
        Counter, "tltd_rollout_samples", "Finished samples", ("job_id", "finish_reason")
    ),
    "simulated_samples": _Declared(
        Counter,
        "tltd_simulated_samples",
        "Finished samples drawn by the simulated engine (backend sim), not computed by a model",
        ("job_id",),
    ),
    "sample_steps": _Declared(
        Counter,
        "tltd_sample_decode_steps",
        "Decode steps of finished samples by mode (speculative or plain)",
        ("job_id", "mode"),
    ),
    "accepted_tokens": _Declared(
        Counter,
        "tltd_accepted_draft_tokens",
        "Draft tokens accepted by the target in finished samples",
        ("job_id",),
    ),
    "decode_steps": _Declared(
        Counter,
        "tltd_engine_decode_steps",
        "Engine decode steps (whole batch) by mode (speculative or plain), per device",
        ("device_id", "mode"),
    ),
    "accepted_length": _Declared(
        Histogram,
        "tltd_accepted_length",
        "Tokens a sequence gained per speculative step (accepted drafts + 1)",
        ("device_id",),
        _ACCEPTED_LENGTH_BUCKETS,
    ),
    "prefix_lookups": _Declared(
        Counter,
        "tltd_prefix_cache_lookups",
        "Session turns whose prefill looked for their session's kept KV, by result: hit "
        "(reused some positions) or miss (prefilled in full)",
        ("device_id", "result"),
    ),
    "prefill_tokens": _Declared(
        Counter,
        "tltd_prefill_tokens",
        "Prompt positions of prefills by source: computed (a forward ran over them) or "
        "reused (a session's kept KV restored)",
        ("device_id", "source"),
    ),
    "session_pins": _Declared(
        Gauge,
        "tltd_session_pins",
        "Open sessions whose KV a worker holds (their last turn ran there; the next one goes "
        "there unless it is re-pinned)",
        ("worker_id",),
    ),
    "session_repins": _Declared(
        Counter,
        "tltd_session_repins",
        "Session turns sent to another worker than the one holding their KV, by reason: gone "
        "(lost with the KV, stopped, cordoned), version (another job or policy version), full or "
        "overloaded (its load, running and queued, beyond the least loaded's by more than the "
        "slack; full also: waiting would cost more than a re-prefill) or rule "
        "(session_placement hash, round_robin)",
        ("reason",),
    ),
    "queue_depth": _Declared(
        Gauge, "tltd_queue_depth", "Samples accepted but not finished, per job", ("job_id",)
    ),
    "drafter_version": _Declared(
        Gauge, "tltd_drafter_version", "Learned drafter version in use (0 = none)", ("job_id",)
    ),
    "policy_version": _Declared(
        Gauge, "tltd_policy_version", "Current policy version", ("job_id",)
    ),
    "preemptions": _Declared(
        Counter,
        "tltd_preemptions",
        "Preemptions of drafter training (or of any work) on a device",
        ("device_id", "reason"),
    ),
    "preemption_latency": _Declared(
        Histogram,
        "tltd_preemption_latency_seconds",
        "From the preemption decision to the device being free",
        buckets=_PREEMPTION_LATENCY_BUCKETS,
    ),
    "worker_failures": _Declared(
        Counter,
        "tltd_rollout_worker_failures",
        "Rollout worker processes lost, by cause: oom_kill (the OOM killer, over "
        "worker_memory_limit_mb), exited (crashed or died by itself), killed (unresponsive, "
        "killed by the daemon)",
        ("worker_id", "cause"),
    ),
    "admission_latency": _Declared(
        Histogram,
        "tltd_admission_latency_seconds",
        "From a Generate call to its request being stored and submitted (validation, "
        "job and device reads, the request's transaction)",
        buckets=_CONTROL_PLANE_BUCKETS,
    ),
    "sample_store_latency": _Declared(
        Histogram,
        "tltd_sample_store_latency_seconds",
        "Store time per finished sample: a batch's transaction divided by its samples",
        buckets=_CONTROL_PLANE_BUCKETS,
    ),
    "sample_store_batch": _Declared(
        Histogram,
        "tltd_sample_store_batch_size",
        "Samples stored per transaction",
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    ),
    "sample_checkpoints": _Declared(
        Counter,
        "tltd_sample_checkpoints_total",
        "Running samples' tokens so far stored as checkpoints (a node that takes a sample "
        "over after a loss goes on from them)",
    ),
    "samples_resumed": _Declared(
        Counter,
        "tltd_samples_resumed_total",
        "Samples that went on from stored tokens instead of running again: from a running "
        "sample's checkpoint, or from a paused or drained sample's partial form",
        ("source",),
    ),
    "groups_sent": _Declared(
        Counter,
        "tltd_bounded_groups_sent_total",
        "Whole groups sent by bounded Generate streams (asynchronous RL); carried: a group "
        "left over by an earlier request of the job",
        ("job_id", "carried"),
    ),
    "group_staleness": _Declared(
        Histogram,
        "tltd_group_staleness_versions",
        "Per group sent by a bounded stream: the job's policy version less the oldest "
        "version any of its tokens came from",
        ("job_id",),
        buckets=(0, 1, 2, 3, 4, 6, 8, 16),
    ),
    "version_spread": _Declared(
        Histogram,
        "tltd_sample_version_spread",
        "Per sample sent by a bounded stream: how many policy versions its tokens span, less "
        "1 (0 = one version; the share above 0 is the partial ratio)",
        ("job_id",),
        buckets=(0, 1, 2, 3, 4, 8),
    ),
    "stale_groups": _Declared(
        Counter,
        "tltd_stale_groups_dropped_total",
        "Groups never sent because a token was older than the job's max_staleness",
        ("job_id",),
    ),
}


class Metrics:
    """All tltd metrics on one registry (module docstring lists the update API)."""

    # Built from _DECLARED; named here for type checkers and readers.
    tokens: Counter
    samples: Counter
    simulated_samples: Counter
    sample_steps: Counter
    accepted_tokens: Counter
    decode_steps: Counter
    accepted_length: Histogram
    prefix_lookups: Counter
    prefill_tokens: Counter
    session_pins: Gauge
    session_repins: Counter
    queue_depth: Gauge
    drafter_version: Gauge
    policy_version: Gauge
    preemptions: Counter
    preemption_latency: Histogram
    worker_failures: Counter
    admission_latency: Histogram
    sample_store_latency: Histogram
    sample_store_batch: Histogram
    sample_checkpoints: Counter
    samples_resumed: Counter
    groups_sent: Counter
    group_staleness: Histogram
    version_spread: Histogram
    stale_groups: Counter

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for attr, declared in _DECLARED.items():
            setattr(self, attr, declared.build(self.registry))
        self._devices = _DeviceClock(clock)
        self._loading = _TrainerLoadingClock(clock)
        self._spec = _SpecRatios()
        self._jobs_lock = threading.Lock()
        self._jobs: set[str] = set()  # jobs with per-job gauges (what forget_job drops)
        self._sample_series: dict[str, _SampleSeries] = {}
        self.registry.register(self._devices)
        self.registry.register(self._loading)
        self.registry.register(self._spec)

    # -- rollout -------------------------------------------------------------------------------

    def observe_sample(
        self,
        job_id: str,
        *,
        tokens: int,
        finish_reason: str,
        draft_steps: int = 0,
        plain_steps: int = 0,
        accepted_tokens: int = 0,
    ) -> None:
        """One finished sample (any finish reason) with its speculative stats."""
        c = self._sample_series.get(job_id)
        if c is None:  # labels() looks a series up under a lock: once per job, not per sample
            c = self._sample_series[job_id] = _SampleSeries(
                self.tokens.labels(job_id),
                self.sample_steps.labels(job_id, "speculative"),
                self.sample_steps.labels(job_id, "plain"),
                self.accepted_tokens.labels(job_id),
                self.simulated_samples.labels(job_id),
            )
            self._seen(job_id)
        c.tokens.inc(tokens)
        finished = c.finished.get(finish_reason)
        if finished is None:
            finished = c.finished[finish_reason] = self.samples.labels(job_id, str(finish_reason))
        finished.inc()
        if draft_steps:
            c.draft_steps.inc(draft_steps)
        if plain_steps:
            c.plain_steps.inc(plain_steps)
        if accepted_tokens:
            c.accepted_tokens.inc(accepted_tokens)
        self._spec.add(job_id, draft_steps, plain_steps, accepted_tokens)

    def observe_groups(
        self,
        job_id: str,
        staleness: list[int],
        carried: list[bool],
        stale: int,
        spreads: Sequence[int] = (),
    ) -> None:
        """Groups a bounded stream sent (their staleness, carried or not, and the version
        spread of each sample) and dropped."""
        for spread in spreads:
            self.version_spread.labels(job_id).observe(spread)
        for versions, was_carried in zip(staleness, carried, strict=True):
            self.groups_sent.labels(job_id, str(was_carried).lower()).inc()
            self.group_staleness.labels(job_id).observe(versions)
        if stale:
            self.stale_groups.labels(job_id).inc(stale)

    def observe_admission(self, seconds: float) -> None:
        self.admission_latency.observe(seconds)

    def observe_sample_writes(self, seconds: float, count: int) -> None:
        """One transaction that stored `count` samples in `seconds`."""
        if count > 0:
            self.sample_store_batch.observe(count)
            observe_many(self.sample_store_latency, seconds / count, count)

    def record_sample(self, job_id: str, sample: Sample) -> None:
        """observe_sample for a domain Sample."""
        spec = sample.speculative
        self.observe_sample(
            job_id,
            tokens=len(sample.token_ids),
            finish_reason=sample.finish_reason.value,
            draft_steps=spec.draft_steps,
            plain_steps=spec.plain_steps,
            accepted_tokens=spec.accepted_tokens,
        )
        if sample.simulated:
            series = self._sample_series.get(job_id)  # (None once the job was forgotten)
            (series.simulated if series else self.simulated_samples.labels(job_id)).inc()

    def observe_decode_steps(
        self,
        device_id: str,
        *,
        plain_steps: int = 0,
        spec_steps: int = 0,
        accepted_lengths: Mapping[int, int] | None = None,
    ) -> None:
        """Engine decode steps since the last report; `accepted_lengths` maps tokens gained
        per sequence per SD step -> how often (EngineStats.accepted_length_hist's delta)."""
        self.decode_steps.labels(device_id, "plain").inc(plain_steps)
        self.decode_steps.labels(device_id, "speculative").inc(spec_steps)
        hist = self.accepted_length.labels(device_id)
        for length, count in (accepted_lengths or {}).items():
            for _ in range(int(count)):
                hist.observe(length)

    def observe_engine_summary(
        self,
        device_id: str,
        previous: Mapping[str, Any] | None,
        current: Mapping[str, Any],
    ) -> None:
        """Feed the difference between two cumulative `EngineStats.summary()`s of one worker
        (e.g. consecutive heartbeats). A fresh engine (a reload) restarts its counters: then
        the current summary is the delta."""
        cur_steps = current.get("steps") or {}
        prev_steps = (previous or {}).get("steps") or {}
        plain = int(cur_steps.get("plain", 0)) - int(prev_steps.get("plain", 0))
        spec = int(cur_steps.get("spec", 0)) - int(prev_steps.get("spec", 0))
        cur_hist = current.get("accepted_length_hist") or {}
        prev_hist = (previous or {}).get("accepted_length_hist") or {}
        if plain < 0 or spec < 0:  # counters went back: a new engine
            plain, spec = int(cur_steps.get("plain", 0)), int(cur_steps.get("spec", 0))
            prev_hist = {}
        hist = {int(k): int(v) - int(prev_hist.get(k, 0)) for k, v in cur_hist.items()}
        self.observe_decode_steps(
            device_id,
            plain_steps=plain,
            spec_steps=spec,
            accepted_lengths={k: v for k, v in hist.items() if v > 0},
        )
        self._observe_prefix(device_id, previous, current)

    def _observe_prefix(
        self, device_id: str, previous: Mapping[str, Any] | None, current: Mapping[str, Any]
    ) -> None:
        """The prefix cache's counters (a torch engine's summary `prefix_cache`) since the
        last summary; a fresh engine's from zero."""
        cur = current.get("prefix_cache") or {}
        prev = (previous or {}).get("prefix_cache") or {}
        names = ("hits", "misses", "prefilled_tokens", "reused_tokens")
        delta = {k: int(cur.get(k, 0)) - int(prev.get(k, 0)) for k in names}
        if any(v < 0 for v in delta.values()):  # counters went back: a new engine
            delta = {k: int(cur.get(k, 0)) for k in names}
        self.prefix_lookups.labels(device_id, "hit").inc(delta["hits"])
        self.prefix_lookups.labels(device_id, "miss").inc(delta["misses"])
        self.prefill_tokens.labels(device_id, "computed").inc(delta["prefilled_tokens"])
        self.prefill_tokens.labels(device_id, "reused").inc(delta["reused_tokens"])

    def set_session_pins(self, worker_id: str, sessions: int) -> None:
        self.session_pins.labels(worker_id).set(sessions)

    def record_repins(self, reasons: Sequence[str]) -> None:
        for reason in reasons:
            self.session_repins.labels(reason).inc()

    def set_queue_depth(self, job_id: str, samples: int) -> None:
        self.queue_depth.labels(job_id).set(samples)
        self._seen(job_id)

    # -- devices, versions, preemption ---------------------------------------------------------

    def set_device_state(self, device_id: str, state: str) -> None:
        """The device's state from now on; time accrues to the previous state until now."""
        self._devices.set_state(device_id, str(state))

    def device_seconds(self) -> dict[tuple[str, str], float]:
        """(device_id, state) -> seconds so far (what the endpoint exports)."""
        return self._devices.seconds()

    def set_trainer_loading(self, device_id: str, loading: bool) -> None:
        """Whether the trainer holding `device_id` (TRAINING) is still starting up."""
        self._loading.set_loading(device_id, loading)

    def trainer_loading_seconds(self) -> dict[str, float]:
        """device_id -> seconds so far TRAINING with the trainer loading."""
        return self._loading.seconds()

    def set_drafter_version(self, job_id: str, version: int) -> None:
        self.drafter_version.labels(job_id).set(version)
        self._seen(job_id)

    def set_policy_version(self, job_id: str, version: int) -> None:
        self.policy_version.labels(job_id).set(version)
        self._seen(job_id)

    def record_preemption(
        self, device_id: str, reason: str = "rollout", latency_seconds: float | None = None
    ) -> None:
        self.preemptions.labels(device_id, reason).inc()
        if latency_seconds is not None:
            self.preemption_latency.observe(latency_seconds)

    def record_worker_failure(self, worker_id: str, cause: str) -> None:
        self.worker_failures.labels(worker_id, cause).inc()

    def _seen(self, job_id: str) -> None:
        with self._jobs_lock:
            self._jobs.add(job_id)

    def job_ids(self) -> set[str]:
        """Jobs that have per-job gauges now (until forget_job)."""
        with self._jobs_lock:
            return set(self._jobs)

    def forget_job(self, job_id: str) -> None:
        """Drop a finished job's per-job gauges (counters keep their totals)."""
        with self._jobs_lock:
            self._jobs.discard(job_id)
        self._sample_series.pop(job_id, None)  # its counters keep their totals
        for gauge in (self.queue_depth, self.drafter_version, self.policy_version):
            try:
                gauge.remove(job_id)
            except KeyError:
                pass
        self._spec.forget(job_id)


# The daemon process's metrics. Tests that assert exact values build their own Metrics.
METRICS = Metrics()


@dataclass
class MetricsServer:
    server: ThreadingHTTPServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(port: int, host: str = "127.0.0.1", metrics: Metrics = METRICS):
    """Serve /metrics on host:port in a daemon thread (port 0: any free port)."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(server, thread)
