"""Prometheus metrics: the update API, the HTTP exposition, the store roll-up and the daemon's
endpoint (a real `tltd serve` scraped over HTTP)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tltd.domain import DeviceState, Job, JobStatus, RolloutRequest, SamplingParams
from tltd.metrics import METRICS, Metrics, start_metrics_server
from tltd.periodic import roll_up_metrics
from tltd.store import Store

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse the exposition: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_samples_feed_tokens_steps_share_and_accepted_length():
    m = Metrics()
    m.observe_sample(
        "j", tokens=10, finish_reason="stop", draft_steps=3, plain_steps=1, accepted_tokens=6
    )
    m.observe_sample("j", tokens=5, finish_reason="length", plain_steps=5)
    m.observe_sample("k", tokens=1, finish_reason="cancelled")
    assert value(m, "tltd_rollout_tokens_total", job_id="j") == 15
    assert value(m, "tltd_rollout_samples_total", job_id="j", finish_reason="stop") == 1
    assert value(m, "tltd_rollout_samples_total", job_id="j", finish_reason="length") == 1
    assert value(m, "tltd_sample_decode_steps_total", job_id="j", mode="speculative") == 3
    assert value(m, "tltd_sample_decode_steps_total", job_id="j", mode="plain") == 6
    assert value(m, "tltd_accepted_draft_tokens_total", job_id="j") == 6
    # 3 SD steps of 9 -> share 1/3; (6 accepted + 3) / 3 SD steps = 3 tokens per SD step.
    assert value(m, "tltd_sd_step_share", job_id="j") == pytest.approx(1 / 3)
    assert value(m, "tltd_mean_accepted_length", job_id="j") == pytest.approx(3.0)
    # A job that never speculated has a share of 0 and no accepted length (not a fake 1.0).
    m.observe_sample("k", tokens=2, finish_reason="stop", plain_steps=2)
    assert value(m, "tltd_sd_step_share", job_id="k") == 0
    assert value(m, "tltd_mean_accepted_length", job_id="k") is None


def test_engine_steps_and_accepted_length_histogram():
    m = Metrics()
    m.observe_decode_steps("cpu:0", plain_steps=7, spec_steps=2, accepted_lengths={1: 1, 4: 3})
    assert value(m, "tltd_engine_decode_steps_total", device_id="cpu:0", mode="plain") == 7
    assert value(m, "tltd_engine_decode_steps_total", device_id="cpu:0", mode="speculative") == 2
    assert value(m, "tltd_accepted_length_count", device_id="cpu:0") == 4
    assert value(m, "tltd_accepted_length_sum", device_id="cpu:0") == 13
    assert value(m, "tltd_accepted_length_bucket", device_id="cpu:0", le="1.0") == 1
    assert value(m, "tltd_accepted_length_bucket", device_id="cpu:0", le="3.0") == 1
    assert value(m, "tltd_accepted_length_bucket", device_id="cpu:0", le="4.0") == 4


def test_device_state_seconds_include_the_open_interval():
    clock = FakeClock()
    m = Metrics(clock=clock)
    m.set_device_state("cpu:0", "idle")
    clock.now += 2
    m.set_device_state("cpu:0", "rollout")
    m.set_device_state("cpu:0", "rollout")  # no change: the interval keeps running
    clock.now += 5
    m.set_device_state("cpu:0", "training")
    clock.now += 1.5  # still training, not closed yet: must show at scrape time

    def secs(state: str) -> float | None:
        return value(m, "tltd_device_state_seconds_total", device_id="cpu:0", state=state)

    assert (secs("idle"), secs("rollout"), secs("training")) == (2.0, 5.0, 1.5)
    clock.now += 1
    assert secs("training") == 2.5
    assert value(m, "tltd_device_state", device_id="cpu:0", state="training") == 1
    assert value(m, "tltd_device_state", device_id="cpu:0", state="rollout") == 0
    assert m.device_seconds()[("cpu:0", "idle")] == 2.0


def test_trainer_loading_seconds_count_only_while_the_trainer_starts():
    clock = FakeClock()
    m = Metrics(clock=clock)
    m.set_device_state("cpu:0", "training")
    m.set_trainer_loading("cpu:0", True)
    clock.now += 3  # spawned, loading: held for training, not training
    m.set_trainer_loading("cpu:0", False)
    clock.now += 4  # up and training
    m.set_trainer_loading("cpu:0", True)  # a second start
    clock.now += 1  # open interval: counted at scrape time

    def loading() -> float | None:
        return value(m, "tltd_device_trainer_loading_seconds_total", device_id="cpu:0")

    assert loading() == 4.0
    assert value(m, "tltd_device_state_seconds_total", device_id="cpu:0", state="training") == 8
    m.set_trainer_loading("cpu:0", False)
    clock.now += 10
    assert loading() == 4.0 and m.trainer_loading_seconds() == {"cpu:0": 4.0}


def test_versions_queue_preemptions_and_forget_job():
    m = Metrics()
    m.set_queue_depth("j", 12)
    m.set_drafter_version("j", 3)
    m.set_policy_version("j", 5)
    m.observe_sample("j", tokens=1, finish_reason="stop", draft_steps=1)
    m.record_preemption("cpu:1", "rollout_arrived", latency_seconds=0.2)
    m.record_preemption("cpu:1", "rollout_arrived")
    assert value(m, "tltd_queue_depth", job_id="j") == 12
    assert value(m, "tltd_drafter_version", job_id="j") == 3
    assert value(m, "tltd_policy_version", job_id="j") == 5
    assert value(m, "tltd_preemptions_total", device_id="cpu:1", reason="rollout_arrived") == 2
    assert value(m, "tltd_preemption_latency_seconds_count") == 1
    m.forget_job("j")
    m.forget_job("never-seen")
    for name in (
        "tltd_queue_depth",
        "tltd_drafter_version",
        "tltd_policy_version",
        "tltd_sd_step_share",
    ):
        assert value(m, name, job_id="j") is None
    assert value(m, "tltd_rollout_tokens_total", job_id="j") == 1  # counters keep totals


def test_http_endpoint_serves_a_parseable_exposition():
    m = Metrics()
    m.observe_sample("j", tokens=42, finish_reason="stop", draft_steps=2, accepted_tokens=4)
    m.set_device_state("cpu:0", "rollout")
    server = start_metrics_server(0, metrics=m)
    try:
        got = scrape(server.port)
        assert got[("tltd_rollout_tokens_total", (("job_id", "j"),))] == 42
        assert got[("tltd_mean_accepted_length", (("job_id", "j"),))] == 3.0
        assert got[("tltd_device_state", (("device_id", "cpu:0"), ("state", "rollout")))] == 1
        assert (
            "tltd_device_state_seconds_total",
            (("device_id", "cpu:0"), ("state", "rollout")),
        ) in got
        m.observe_sample("j", tokens=8, finish_reason="stop")
        assert scrape(server.port)[("tltd_rollout_tokens_total", (("job_id", "j"),))] == 50
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(server.port)


def test_roll_up_mirrors_the_store(migrated_sqlite_url, tmp_path):
    sqlite_url = migrated_sqlite_url
    store = Store(sqlite_url)
    try:
        from tests.api.support import seed_devices, write_model_dir

        seed_devices(store, 2)
        model = str(write_model_dir(tmp_path / "model"))
        store.jobs.create(Job(job_id="rj", model_path=model))
        store.policies.add("rj", "checkpoint", model)
        store.requests.create(
            RolloutRequest("r1", "rj", ((1, 2), (3,)), SamplingParams(n=4, max_new_tokens=8))
        )
        store.devices.set_state("cpu:1", DeviceState.ROLLOUT, "test")
        m = Metrics()
        roll_up_metrics(store, m)
        assert value(m, "tltd_queue_depth", job_id="rj") == 8
        assert value(m, "tltd_policy_version", job_id="rj") == 1
        assert value(m, "tltd_drafter_version", job_id="rj") == 0
        assert value(m, "tltd_device_state", device_id="cpu:0", state="idle") == 1
        assert value(m, "tltd_device_state", device_id="cpu:1", state="rollout") == 1

        # A job that left ACTIVE loses its gauges instead of freezing at its last values;
        # its counters keep their totals. Active jobs keep theirs.
        store.jobs.create(Job(job_id="other", model_path=model))
        m.observe_sample("rj", tokens=5, finish_reason="stop", draft_steps=1, plain_steps=1)
        roll_up_metrics(store, m)
        assert value(m, "tltd_sd_step_share", job_id="rj") == 0.5
        store.jobs.set_status("rj", JobStatus.CANCELLED, "test")
        roll_up_metrics(store, m)
        for name in (
            "tltd_queue_depth",
            "tltd_policy_version",
            "tltd_drafter_version",
            "tltd_sd_step_share",
        ):
            assert value(m, name, job_id="rj") is None, name
        assert value(m, "tltd_rollout_tokens_total", job_id="rj") == 5
        assert value(m, "tltd_policy_version", job_id="other") == 0
        assert m.job_ids() == {"other"}
    finally:
        store.close()


def test_daemon_serves_metrics_on_its_port(tmp_path):
    port = free_port()
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
    log = open(tmp_path / "tltd.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tltd",
            "serve",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--data-dir",
            str(tmp_path / "data"),
            "--cpu-slots",
            "2",
            "--metrics-port",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "tltd.log"
            ).read_text()
            time.sleep(0.05)
        got = scrape(port)
        for device in ("cpu:0", "cpu:1"):
            assert got[("tltd_device_state", (("device_id", device), ("state", "idle")))] == 1
        # A second daemon on the same metrics port refuses to start, with a reason, exit 2.
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "tltd",
                "serve",
                "--port",
                "0",
                "--data-dir",
                str(tmp_path / "data2"),
                "--metrics-port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert f"cannot serve metrics on port {port}" in second.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(urllib.error.URLError):
            scrape(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_process_wide_metrics_exist():
    assert isinstance(METRICS, Metrics)
    names = {f.name for f in METRICS.registry.collect()}
    for name in (
        "tltd_rollout_tokens",
        "tltd_accepted_length",
        "tltd_sd_step_share",
        "tltd_queue_depth",
        "tltd_device_state_seconds",
        "tltd_drafter_version",
        "tltd_preemptions",
        "tltd_rollout_worker_failures",
    ):
        assert name in names, name


def test_record_sample_reads_a_domain_sample():
    from tltd.domain import FinishReason, Sample, SpeculativeStats

    m = Metrics()
    spec = SpeculativeStats(draft_steps=2, plain_steps=2, accepted_tokens=4)
    m.record_sample("j", Sample("r", 0, 0, (5, 6, 7), (-1.0,) * 3, FinishReason.LENGTH,
                                speculative=spec))  # fmt: skip
    assert value(m, "tltd_rollout_tokens_total", job_id="j") == 3
    assert value(m, "tltd_rollout_samples_total", job_id="j", finish_reason="length") == 1
    assert value(m, "tltd_mean_accepted_length", job_id="j") == 3.0
    assert value(m, "tltd_sd_step_share", job_id="j") == 0.5


def test_engine_summaries_become_step_deltas_and_survive_a_reload():
    from tltd_workers.engine.stats import EngineStats

    m = Metrics()
    stats = EngineStats()
    stats.record_plain_step(8, 8, 0.1)
    stats.record_spec_step(2, "ngram-4", [4, 4], [3, 1], [4, 2], 0.01, 0.02)
    first = stats.summary()
    m.observe_engine_summary("cpu:0", None, first)
    stats.record_plain_step(4, 4, 0.1)
    stats.record_spec_step(1, "ngram-4", [4], [4], [5], 0.01, 0.02)
    second = stats.summary()
    m.observe_engine_summary("cpu:0", first, second)
    m.observe_engine_summary("cpu:0", second, second)  # nothing new: nothing counted

    def steps(mode: str) -> float | None:
        return value(m, "tltd_engine_decode_steps_total", device_id="cpu:0", mode=mode)

    assert (steps("plain"), steps("speculative")) == (2, 2)
    assert value(m, "tltd_accepted_length_count", device_id="cpu:0") == 3  # rows 4, 2, 5
    assert value(m, "tltd_accepted_length_sum", device_id="cpu:0") == 11
    # The worker reloaded its model: a fresh engine's counters start again from zero.
    fresh = EngineStats()
    fresh.record_plain_step(2, 2, 0.1)
    m.observe_engine_summary("cpu:0", second, fresh.summary())
    assert (steps("plain"), steps("speculative")) == (3, 2)


def test_prefix_cache_counters_become_deltas_and_survive_a_reload():
    from tltd_workers.engine.prefix_cache import PrefixStats

    m = Metrics()
    a = PrefixStats(hits=2, misses=1, reused_tokens=90, prefilled_tokens=30).summary(0, 0)
    b = PrefixStats(hits=5, misses=1, reused_tokens=300, prefilled_tokens=45).summary(0, 0)
    m.observe_engine_summary("cpu:0", None, {"prefix_cache": a})
    m.observe_engine_summary("cpu:0", {"prefix_cache": a}, {"prefix_cache": b})
    m.observe_engine_summary("cpu:0", {"prefix_cache": b}, {"prefix_cache": b})  # nothing new

    def counts():
        return (
            value(m, "tltd_prefix_cache_lookups_total", device_id="cpu:0", result="hit"),
            value(m, "tltd_prefix_cache_lookups_total", device_id="cpu:0", result="miss"),
            value(m, "tltd_prefill_tokens_total", device_id="cpu:0", source="computed"),
            value(m, "tltd_prefill_tokens_total", device_id="cpu:0", source="reused"),
        )

    assert counts() == (5, 1, 45, 300)
    fresh = PrefixStats(hits=1, prefilled_tokens=4, reused_tokens=10).summary(0, 0)
    m.observe_engine_summary("cpu:0", {"prefix_cache": b}, {"prefix_cache": fresh})  # a reload
    assert counts() == (6, 1, 49, 310)


def test_observe_many_is_the_same_as_observing_one_by_one() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    from tltd.metrics import observe_many

    registry = CollectorRegistry()
    many = Histogram("many", "h", buckets=(0.001, 0.01, 0.1), registry=registry)
    each = Histogram("each", "h", buckets=(0.001, 0.01, 0.1), registry=registry)
    for value, count in [(0.004, 16), (0.0005, 1), (0.2, 3), (0.01, 2), (0.05, 0)]:
        observe_many(many, value, count)
        for _ in range(count):
            each.observe(value)

    def samples(name: str) -> dict:
        return {
            (s.name.removeprefix(name), tuple(sorted(s.labels.items()))): s.value
            for f in registry.collect() if f.name == name for s in f.samples
            if not s.name.endswith("_created")
        }  # fmt: skip

    got, want = samples("many"), samples("each")
    assert got.keys() == want.keys() and got[("_count", ())] == 22
    assert all(abs(got[k] - want[k]) < 1e-9 for k in want)
