"""Rollout traces: what the engine did per step, recorded from outside it, as JSON lines.

A `run` line holds one pass of one engine (a benchmark's pass, or a worker's busy period: from
the step that found work to the step that left none): its configuration, per prompt its
context length, samples, arrival (s after the pass began), token cap, earlier answers given to
the history drafter and a key of its tokens; per sample its length; per step its wall time,
running batch and kind: a prefill (the prompts it admitted), a plain pass, or an SD pass with
per row the sample, its position (tokens emitted before the step), drafts verified, drafts
accepted, tokens gained and the drafter that proposed them; when each step began and (in a
worker) its CPU time; and when the (policy, drafter) versions in use changed.
`benchmarks/sim_rollout.py` replays such passes under a device's step costs.

Recording reads the engine before a step (its waiting and running rows) and after it
(`EngineStats.step_log`): the engine decides exactly as it does unrecorded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltd_workers.engine.datatypes import SampleOutput
from tltd_workers.engine.engine import Engine
from tltd_workers.engine.rows import Group

PREFILL = "prefill"


def prompt_key(prompt: Sequence[int]) -> str:
    """A short key of a prompt's tokens (the history drafter keys its answers by them)."""
    return format(hash(tuple(prompt)) & 0xFFFF_FFFF_FFFF, "x")


@dataclass
class Recorder:
    """Records one pass of `engine`: call `before()` and `after(seconds, done)` around every
    engine.step(); `run(seconds, ...)` returns the trace line and stops recording."""

    engine: Engine
    log: list[tuple] = field(default_factory=list)
    # per prompt: id, context tokens, n, arrival (s), max_new_tokens, earlier answers, key
    groups: list[list[Any]] = field(default_factory=list)
    samples: dict[tuple[str, int], int] = field(default_factory=dict)  # (prompt, i) -> id
    lengths: dict[int, int] = field(default_factory=dict)
    steps: list[list[Any]] = field(default_factory=list)
    at: list[float] = field(default_factory=list)  # when each step began (s into the pass)
    # CPU seconds of each step in the recording thread (the engine's, with one torch thread):
    # its cost without the other processes a shared machine ran meanwhile. Empty: not timed.
    cpu: list[float] = field(default_factory=list)
    versions: list[list[float]] = field(default_factory=list)  # [s, policy, drafter] changes
    _ids: dict[int, tuple[Group, str]] = field(default_factory=dict)  # id(group) -> its id
    _outputs: dict[tuple[str, int, int], tuple[str, int]] = field(default_factory=dict)
    _rows: list[tuple[int, int]] = field(default_factory=list)
    _waiting: list[str] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter)
    _now: float = 0.0

    def __post_init__(self) -> None:
        self.engine.stats.step_log = self.log

    def before(self) -> None:
        e = self.engine
        now = time.perf_counter() - self._t0
        versions = [e.policy_version, e.drafter_version]
        if not self.versions or self.versions[-1][1:] != versions:
            self.versions.append([now, *versions])
        for g in e.waiting:
            self._group(g, now)
        self._rows = [(self._sid(s.group, s.index), len(s.tokens)) for s in e.running]
        self._waiting = [self._group(g, now) for g in e.waiting]
        self._now = now
        self.log.clear()

    def after(
        self, seconds: float, done: Sequence[SampleOutput], cpu_seconds: float | None = None
    ) -> None:
        steps = len(self.steps)
        self._after(seconds, done)
        if len(self.steps) > steps:
            self.at.append(round(self._now, 6))
            if cpu_seconds is not None:
                self.cpu.append(round(cpu_seconds, 7))

    def _after(self, seconds: float, done: Sequence[SampleOutput]) -> None:
        e = self.engine
        for o in done:
            got = self._outputs.get((o.request_id, o.prompt_index, o.sample_index))
            if got is not None:
                self.lengths[self.samples.setdefault(got, len(self.samples))] = len(o.token_ids)
        if not self.log:  # no decode pass: a prefill (or nothing ran)
            still = {self._ids[id(g)][1] for g in e.waiting if id(g) in self._ids}
            admitted = [r for r in self._waiting if r not in still]
            if admitted:
                self.steps.append([seconds, len(self._rows), PREFILL, admitted])
            return
        arm, *per_row = self.log[0]
        if arm == "plain":
            self.steps.append([seconds, len(self._rows), arm, None])
            return
        drafted, accepted, emitted, kinds = per_row
        rows = [
            [sid, pos, d, a, g, kind]
            for (sid, pos), d, a, g, kind in zip(
                self._rows, drafted, accepted, emitted, kinds, strict=True
            )
        ]
        self.steps.append([seconds, len(self._rows), arm, rows])

    def run(self, seconds: float, **meta: Any) -> dict[str, Any]:
        """The trace line of this pass: `meta` (mode, repeat, worker, ...) and what was
        recorded. Recording stops (the engine's step log is released)."""
        self.engine.stats.step_log = None
        samples = sorted(self.samples.items(), key=lambda kv: kv[1])
        cfg = self.engine.config
        return {
            "type": "run",
            **meta,
            "seconds": seconds,
            "config": {
                "spec_mode": cfg.spec_mode,
                "gate": cfg.gate,
                "strategies": [s.name for s in cfg.strategies],
                "max_batch": cfg.max_batch,
                "batch_threshold": cfg.batch_threshold,
                "max_prefill_tokens": cfg.max_prefill_tokens,
                "seed": cfg.seed,
                "drafter": self.engine.drafter is not None,
            },
            "groups": self.groups,
            "samples": [[r, i, self.lengths.get(sid, 0)] for (r, i), sid in samples],
            "steps": self.steps,
            "at": self.at,
            "cpu": self.cpu,
            "versions": self.versions,
        }

    def _group(self, g: Group, now: float) -> str:
        """The prompt's id in this pass (registered the first time it is seen waiting)."""
        known = self._ids.get(id(g))
        if known is not None and known[0] is g:
            return known[1]
        gid = f"{g.request_id}/{g.prompt_index}/{g.sample_offset}"
        if any(row[0] == gid for row in self.groups):  # the same slice again (a retry)
            gid += f"#{len(self.groups)}"
        self._ids[id(g)] = (g, gid)
        n = g.sampling.n
        self.groups.append(
            [gid, len(g.context), n, now, g.sampling.max_new_tokens, len(g.past),
             prompt_key(g.prompt)]
        )  # fmt: skip
        for i in range(n):
            self._outputs[(g.request_id, g.prompt_index, g.sample_offset + i)] = (gid, i)
        return gid

    def _sid(self, g: Group, index: int) -> int:
        key = (self._group(g, time.perf_counter() - self._t0), index - g.sample_offset)
        return self.samples.setdefault(key, len(self.samples))


class EngineTrace:
    """A rollout worker's trace file: one `run` line per busy period of its engine (`step`
    wraps each engine.step()), with the worker, the job, the engine (a count of the models
    this worker loaded) and the wall-clock start (`time.time()`) of the period."""

    def __init__(self, path: str | Path, worker: str) -> None:
        self.path = Path(path)
        self.worker = worker
        self.engines = 0
        self._rec: Recorder | None = None
        self._meta: dict[str, Any] = {}
        self._first = self._last = 0.0

    def step(self, engine: Engine, job_id: str) -> list[SampleOutput]:
        """engine.step(), recorded; the period's line is written once the engine is idle."""
        if self._rec is None:
            self._rec = Recorder(engine)
            self._first = time.perf_counter()
            self._meta = {"worker": self.worker, "job": job_id, "engine": self.engines,
                          "start": time.time(), "pid": os.getpid()}  # fmt: skip
        self._rec.before()
        c0, t0 = time.thread_time(), time.perf_counter()
        done = engine.step()
        self._last = time.perf_counter()
        self._rec.after(self._last - t0, done, time.thread_time() - c0)
        if not engine.has_work():
            self.flush()
        return done

    def engine_loaded(self) -> None:
        """A new engine replaces the old one: the old one's period ends here."""
        self.flush()
        self.engines += 1

    def flush(self) -> None:
        """Write the current period's line (if it ran a step) and stop recording it."""
        rec, self._rec = self._rec, None
        if rec is None:
            return
        line = rec.run(self._last - self._first, **self._meta)
        if line["steps"]:
            write_line(self.path, line)


def write_line(path: Path, line: dict[str, Any]) -> None:
    """Append one line to a trace file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")
