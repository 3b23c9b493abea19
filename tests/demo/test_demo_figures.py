"""The demo's figures on inputs with a known answer: the harvest from a synthetic device timeline
(the daemon's scheduler and state rule, its metrics clock), the shadow's drafter versions
promoted before their step, and the held-out standard error taken over prompts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from examples.grpo_demo import QUICK, pick_then_roll_out, windows
from examples.heldout import paired
from tltd.domain import DeviceState
from tltd.metrics import Metrics
from tltd.scheduler import (
    DeviceView,
    JobView,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    TrainingView,
    schedule,
)
from tltd.supervisor.rollout_workers import rollout_device_state

# Rollout work per device, as [start, end) intervals of seconds. d0 runs the rollout's tail to
# the end of the window; d1 runs out of work at 2.0, gets more at 2.3 (a 0.3 s spell, shorter
# than the 0.5 s grace: no training can start in it), and runs out for good at 4.0.
TIMELINE = {"d0": [(0.0, 10.0)], "d1": [(0.0, 2.0), (2.3, 4.0)]}
WINDOW_END = 10.0
GRACE = 0.5


def _busy(device: str, now: float) -> int:
    return sum(1 for a, b in TIMELINE[device] if a <= now < b)


def _replay(tick: float = 0.1) -> dict[tuple[str, str], float]:
    """Each tick: the scheduler's decision on the timeline's snapshot, then the states the
    daemon records (training where it started, else the rollout workers' rule), timed by the
    metrics' device clock. Returns (device, state) -> seconds at the window's end."""
    clock = SimpleNamespace(now=0.0)
    metrics = Metrics(registry=CollectorRegistry(), clock=lambda: clock.now)
    cfg = SchedulerConfig(idle_grace_seconds=GRACE, train_during_rollout_only=True)
    idle_since: dict[str, float | None] = {d: None for d in TIMELINE}
    training: list[TrainingView] = []
    for k in range(int(round(WINDOW_END / tick))):
        clock.now = k * tick
        busy = {d: _busy(d, clock.now) for d in TIMELINE}
        for d, b in busy.items():
            idle_since[d] = (
                None if b else (idle_since[d] if idle_since[d] is not None else clock.now)
            )
        snap = Snapshot(
            now=clock.now,
            devices=tuple(DeviceView(d, True) for d in TIMELINE),
            workers=tuple(
                RolloutWorkerView(f"w-{d}", d, "job", True, running_samples=busy[d],
                                  idle_since=idle_since[d])
                for d in TIMELINE
            ),
            training=tuple(training),
            pending=(),
            jobs=(JobView("job", fresh_samples=64),),
        )  # fmt: skip
        decision = schedule(snap, cfg)
        assert not decision.preempt_training  # the job rolls out to the window's end
        training += list(decision.start_training)
        on_training = {t.device_id for t in training}
        for d in TIMELINE:
            state = DeviceState.TRAINING if d in on_training else rollout_device_state(busy[d])
            metrics.set_device_state(d, state.value)
    clock.now = WINDOW_END
    return metrics.device_seconds()


def test_harvest_counts_every_idle_second_including_the_grace_and_a_short_spell():
    seconds = _replay()
    # d1: rollout 2.0 + 1.7 s; idle 0.3 s (the short spell) + 0.5 s (the grace after 4.0);
    # training from 4.5 s to the end. d0 ran rollout work throughout.
    assert seconds[("d1", "rollout")] == pytest.approx(3.7)
    assert seconds[("d1", "idle")] == pytest.approx(0.8)
    assert seconds[("d1", "training")] == pytest.approx(5.5)
    assert seconds[("d0", "rollout")] == pytest.approx(10.0)
    assert ("d0", "idle") not in seconds and ("d0", "training") not in seconds
    totals: dict[str, float] = {}
    for (_, state), value in seconds.items():
        totals[state] = totals.get(state, 0.0) + value
    window = windows({}, totals, totals, totals)  # the demo's own arithmetic
    assert window.rollout_idle == pytest.approx(0.8)
    assert window.rollout_trained == pytest.approx(5.5)
    # 5.5 of the 6.3 device-seconds without rollout work; a device left "rollout" until the
    # scheduler listed it idle would have shown 5.5 of 5.5.
    assert window.harvested == pytest.approx(5.5 / 6.3)


class _Daemon:
    """A job whose drafter versions are promoted at given times; each sample takes 1 s and
    carries the version in service when it finishes."""

    def __init__(self, promote_at: dict[int, float]) -> None:
        self.now = 0.0
        self.promote_at = promote_at  # version -> promotion time
        self.raw = self  # the client's raw stub: get_job, list_devices

    def active(self) -> int:
        return max(v for v, t in self.promote_at.items() if t <= self.now)

    def get_job(self, job_id: str) -> SimpleNamespace:
        return SimpleNamespace(job_id=job_id, drafter_version=self.active())

    def list_devices(self) -> list:
        return []

    def stream(self, prompts, n, **_):
        for p in range(len(prompts)):
            for i in range(n):
                self.now += 1.0
                yield SimpleNamespace(prompt_index=p, sample_index=i, drafter_version=self.active())


def test_shadow_scores_only_versions_promoted_before_the_step_began():
    # Steps take `per_step` seconds with a 5 s update after each. Version 2 is promoted in the
    # middle of step 1's rollout (it may have trained on that step's first samples), version 3
    # during the update after step 1.
    prompts = [[1, 2], [1, 3]]
    per_step = len(prompts) * QUICK.n
    step_start = [k * (per_step + 5.0) for k in range(3)]
    daemon = _Daemon({1: -1.0, 2: step_start[1] + 2.5, 3: step_start[1] + per_step + 2.0})
    scored, newest = [], []
    for step in range(3):
        daemon.now = step_start[step]
        version, (samples, _, _) = pick_then_roll_out(
            daemon, "job", prompts, QUICK, seed=step, label=f"step {step}"
        )
        assert daemon.promote_at[version] <= step_start[step]  # before the step's first sample
        scored.append(version)
        newest.append(max(s.drafter_version for s in samples))
    assert scored == [1, 1, 3]
    # The samples' newest version (what was scored before) names version 2 at step 1: promoted
    # during that step.
    assert newest == [1, 2, 3]


def test_paired_standard_error_is_taken_over_prompts():
    # 4 prompts x 4 samples; before all 0. Per-prompt mean differences 0.5, 0, 1, 0.25.
    after = [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    prompts = [p for p in range(4) for _ in range(4)]
    before = [0.0] * 16
    mean, se = paired(before, after, prompts)
    assert mean == pytest.approx(0.4375)
    # sd of (0.5, 0, 1, 0.25) with n - 1 = 3: sqrt(0.546875 / 3); over sqrt(4) prompts.
    assert se == pytest.approx(math.sqrt(0.546875 / 3 / 4))
    assert se == pytest.approx(0.213478, abs=1e-6)
    # Treating the 16 samples as independent gives a standard error 1.7x too small here.
    naive_mean, naive_se = paired(before, after)
    assert naive_mean == pytest.approx(mean)
    assert naive_se == pytest.approx(math.sqrt(3.9375 / 15 / 16))
    # Cluster labels need not be contiguous: the samples' order does not matter.
    shuffled = list(range(16))[::-1]
    _, se_shuffled = paired([before[i] for i in shuffled], [after[i] for i in shuffled],
                            [prompts[i] for i in shuffled])  # fmt: skip
    assert se_shuffled == pytest.approx(se)
    with pytest.raises(ValueError, match="clusters"):
        paired(before, after, prompts[:-1])
