"""The SGLang rollout worker process: the shared worker loop over an SGLang engine.

Same pipe protocol as the torch worker (`tltd_workers.rollout.loop`). The engine is any object
with the `tltd_workers.sglang.translate.SglangEngine` methods, built by a factory named on the
command line of the process ("module:function"; default
`tltd_workers.sglang.engine:make_engine`, which imports sglang), so that the tests run
this module over a fake `sglang.Engine`.

- Every sample is its own engine request (its own seed, abort and result). A "step" is a poll
  of at most `POLL_SECONDS` for generations that ended.
- Heartbeats count tokens from the requests' budgets (SGLang reports nothing until a request
  ends), an upper bound as the protocol asks; their stats carry SGLang's speculative counters
  of the finished samples in the metrics' shape (`steps`, `accepted_length_hist`).
- `LoadPolicy` updates the target weights in place, tagged with the policy version as SGLang's
  `weight_version`; every sample's `meta_info.weight_version` is checked against the version
  the worker recorded for it.
- `SetDrafter`: the drafter version is exported to an SGLang EAGLE checkpoint
  (`tltd_workers.drafter.versions.export_sglang`) and loaded into SGLang's draft runner alone,
  while the samples run. Only a change of speculative algorithm (NGRAM or none before, EAGLE
  after, or back) restarts the engine; the samples running then are *carried over*: aborted,
  they keep their tokens and logprobs and continue in the new engine from prompt + tokens so
  far with the remaining budget and a fresh per-segment seed. The continuation is drawn from
  the same target given the same prefix, so the sample's distribution is unchanged.
- A sample SGLang stopped at the model's EOS where the caller gave other stop ids continues
  the same way (a new segment), so that only the caller's stop ids end a sample.
- `JoinBroadcast`: the engine joins the trainer's group through SGLang's distributed weight
  update and receives the tensors straight into its target weights. SGLang cannot hold them
  beside the weights it serves, so only an idle SGLang worker is asked to join (a busy one
  loads the version from the file once its work on the older one is done), and it pauses
  from the join until the daemon records the version: samples that arrive meanwhile wait,
  and one still running at the join is started over (its tokens dropped), so that no sample
  mixes two versions' tokens (its LoadPolicy then only sets SGLang's `weight_version`, and
  the samples run on it). A broadcast that fails, or whose version is not recorded within
  the broadcast's timeout after it arrived, or a LoadPolicy of another version, puts the
  recorded weights back from the file; the samples then continue on those. So no token is
  drawn from weights that are not a recorded version. An engine still waiting in the group
  when another version is recorded (a trainer that never came, or fell back to a gRPC push)
  restarts on that version rather than wait out torch's group timeout.
- Idle for `RELEASE_AFTER_SECONDS`, the worker releases the engine's GPU memory (KV cache,
  weights) for the drafter trainer; the next request or update takes it back.
- A request's `speculative` flag cannot be honoured per request: SGLang speculates for the
  whole engine (losslessly, so only speed differs).
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from tltd.contract.lengths import new_token_cap
from tltd.contract.rollout_messages import AddWork, EngineSpec, JoinBroadcast, LoadModel
from tltd.domain import FinishReason, Sample, SamplingParams, SpeculativeStats
from tltd_workers.rollout.loop import WorkerLoop, describe, serve
from tltd_workers.sglang.translate import (
    EngineFactory,
    Segment,
    SglangEngine,
    StepCounters,
    WeightUpdate,
    adaptive_config,
    distributed_join,
    engine_args,
    finish_reason,
    read_output,
    sample_seed,
    sampling_params,
    stopped_outside,
)
from tltd_workers.signals import ignore_stop_signals

DEFAULT_FACTORY = "tltd_workers.sglang.engine:make_engine"
POLL_SECONDS = 0.02  # one step: the longest a poll waits (commands are read in between)
ABORT_WAIT_SECONDS = 10.0  # how long a drain or restart waits for aborted requests to report
RELEASE_AFTER_SECONDS = 2.0  # idle this long: the GPU memory goes to the drafter trainer
VERSION_WAIT_SECONDS = 10.0  # a LoadPolicy of a broadcast waits this long for its last tensor


def main(
    conn: Connection,
    threads: int = 1,
    heartbeat_seconds: float = 0.5,
    engine_factory: str = DEFAULT_FACTORY,
) -> None:
    """Process entry point (multiprocessing spawn target; not daemonic: SGLang starts its own
    scheduler processes). `threads` is unused: the model runs in SGLang's processes."""
    ignore_stop_signals()
    serve(conn, SglangWorker(conn, heartbeat_seconds, load_factory(engine_factory)))


def load_factory(path: str) -> EngineFactory:
    """The function a "package.module:function" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _eagle_version(args: dict[str, Any], drafter_version: int) -> int:
    """The drafter version an engine started with `args` speculates with (0: not EAGLE)."""
    return drafter_version if args.get("speculative_algorithm") == "EAGLE" else 0


@dataclass
class _Running:
    """One sample in the engine; its tokens so far survive engine restarts (segments)."""

    request_id: str
    prompt_index: int
    sample_index: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_new: int  # max_new_tokens capped by max_seq_len
    policy_version: int
    rid: str = ""  # the engine request of the current segment
    segment: int = 0
    drafter_version: int = 0  # the EAGLE drafter of the current segment (0: none)
    segment_policy: int = 0  # the policy version loaded when the current segment started
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)  # of the segments that ended
    logprobs: list[float] = field(default_factory=list)
    spec_steps: int = 0
    accepted: int = 0
    plain_steps: int = 0
    drafted: int = 0

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.tokens)

    def absorb(self, seg: Segment) -> None:
        self.tokens += seg.token_ids
        self.logprobs += seg.logprobs
        self.spec_steps += seg.spec_steps
        self.accepted += seg.accepted
        self.plain_steps += seg.plain_steps
        self.drafted += seg.drafted

    def start_over(self) -> None:
        """Drop the tokens so far: the sample runs again from its prompt and first seed."""
        self.tokens, self.logprobs, self.segment = [], [], 0
        self.spec_steps = self.accepted = self.plain_steps = self.drafted = 0

    def to_sample(self, reason: FinishReason, error: str = "") -> Sample:
        return Sample(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=reason,
            policy_version=self.policy_version,
            drafter_version=self.drafter_version,
            speculative=SpeculativeStats(
                draft_steps=self.spec_steps,
                plain_steps=self.plain_steps,
                accepted_tokens=self.accepted,
                drafted_tokens=self.drafted,
                mean_accepted_length=(
                    (self.accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0
                ),
            ),
            partial=reason not in (FinishReason.STOP, FinishReason.LENGTH),
            error=error,
        )


@dataclass
class _Broadcast:
    """A broadcast the engine joined: receiving, then received until its version is
    recorded (or `deadline` passes)."""

    path: str
    timeout: float
    received: bool = False
    deadline: float = 0.0  # monotonic, once received


class SglangWorker(WorkerLoop):
    """The shared loop over an SGLang engine (see the module docstring)."""

    # SGLang's scheduler runs the requests in its own processes: not polling them does not
    # stop them, so a job paused with requests kept in place lets them go on here.
    can_freeze = False

    def __init__(self, conn: Connection, heartbeat_seconds: float, factory: EngineFactory) -> None:
        super().__init__(conn, heartbeat_seconds)
        self.factory = factory
        self.engine: SglangEngine | None = None
        self.spec = EngineSpec()
        self.args: dict[str, Any] = {}  # what the running engine was started with
        self.policy_path = ""
        self._policy_version = 0
        self.export_dir = ""  # the current drafter's SGLang export (ours to delete)
        self.adaptive_path = ""  # the job's speculative_adaptive_config file (ours to delete)
        self.running: dict[str, _Running] = {}  # engine rid -> sample
        self.done: list[Sample] = []  # ended outside a step (restart): sent by the next step
        self.counters: Counter[str] = Counter()
        self.steps = StepCounters()
        self.broadcast: _Broadcast | None = None
        self.held: list[_Running] = []  # samples waiting while a broadcast is received
        self.errors: list[str] = []  # for the daemon's log

    # -- state ----------------------------------------------------------------------------

    def loaded(self) -> bool:
        return self.engine is not None

    def policy_version(self) -> int:
        return self._policy_version if self.engine is not None else 0

    def busy(self) -> bool:
        return bool(self.running or self.done or self.held or self.broadcast)

    def broadcast_errors(self) -> list[str]:
        out, self.errors = self.errors, []
        return out

    def load_summary(self) -> tuple[int, int, dict[str, object]]:
        running = len(self.running) + len(self.held)
        remaining = sum(s.remaining for s in [*self.running.values(), *self.held])
        stats: dict[str, object] = {
            "backend": "sglang",
            "speculative": self.args.get("speculative_algorithm") or "off",
            **self.counters,
            **self.steps.summary(),
        }
        # Called at every heartbeat, also while idle: the moment to hand the GPU over.
        idle = self.idle_since is not None and time.time() - self.idle_since
        if self.engine is not None and not self.busy() and idle and idle >= RELEASE_AFTER_SECONDS:
            self.engine.release_memory()
        return running, remaining, stats

    # -- work -----------------------------------------------------------------------------

    def add(self, msg: AddWork) -> None:
        eagle = _eagle_version(self.args, self.drafter_version)
        cap = new_token_cap(msg.sampling.max_new_tokens, len(msg.prompt_ids), self.spec.max_seq_len)
        if len(msg.prompt_ids) >= self.spec.max_seq_len:  # as the torch engine: no room left
            error = f"prompt of {len(msg.prompt_ids)} tokens >= max_seq_len {self.spec.max_seq_len}"
            self.fail(msg, msg.sample_indices, error)
            return
        for i in msg.sample_indices:
            s = _Running(
                msg.request_id,
                msg.prompt_index,
                i,
                tuple(msg.prompt_ids),
                msg.sampling,
                cap,
                self._policy_version,
            )
            self._submit(s, eagle)

    def _submit(self, s: _Running, eagle_version: int) -> None:
        """Start the sample's next segment, or finish it when nothing is left to generate."""
        assert self.engine is not None
        if s.tokens and s.tokens[-1] in s.sampling.stop_token_ids:
            self.done.append(s.to_sample(FinishReason.STOP))  # it stopped as it was carried
            return
        if s.remaining <= 0:
            self.done.append(s.to_sample(FinishReason.LENGTH))
            return
        if self.broadcast is not None:  # the engine's weights are no recorded version now
            self.held.append(s)
            return
        seed = s.sampling.seed
        if seed is not None:
            seed = sample_seed(seed, s.prompt_index, s.sample_index, s.segment)
        params = sampling_params(s.sampling, max_new_tokens=s.remaining, seed=seed)
        s.rid, s.drafter_version = uuid.uuid4().hex, eagle_version
        s.segment_policy = self._policy_version
        if not s.tokens:  # held back until now: its first token comes from these weights
            s.policy_version = self._policy_version
        try:
            self.engine.submit(s.rid, s.prompt + tuple(s.tokens), params)
        except Exception as exc:  # a request the engine refuses outright
            self.done.append(s.to_sample(FinishReason.FAILED, describe(exc)))
            return
        self.running[s.rid] = s
        self.counters["prefills"] += 1

    def step(self) -> list[Sample]:
        finished, self.done = self.done, []
        if self.engine is None:  # a failed restart left only results to send
            return finished
        finished += self._poll(POLL_SECONDS)
        if self.broadcast is not None:
            self._advance_broadcast()
        finished, self.done = finished + self.done, []
        return finished

    def _poll(self, timeout: float) -> list[Sample]:
        assert self.engine is not None
        finished = []
        for rid, out in self.engine.poll(timeout):
            s = self.running.pop(rid, None)
            if s is not None:  # else: a segment of a sample already returned
                sample = self._finish(s, out)
                if sample is not None:
                    finished.append(sample)
        return finished

    def _finish(self, s: _Running, out: dict[str, Any]) -> Sample | None:
        """The sample whose segment ended with `out`, or None when it goes on."""
        try:
            seg = read_output(out)
        except ValueError as exc:
            return s.to_sample(FinishReason.FAILED, str(exc))
        s.absorb(seg)
        self.steps.add(seg)
        if seg.weight_version and seg.weight_version != str(s.segment_policy):
            v = int(seg.weight_version) if seg.weight_version.isdigit() else -1
            if s.segment == 0 and s.segment_policy < v <= self._policy_version:
                s.policy_version = v  # queued across a LoadPolicy: drawn from the new weights
            else:
                error = (
                    f"sglang generated with weight_version {seg.weight_version}, "
                    f"the worker recorded policy version {s.segment_policy}"
                )
                return s.to_sample(FinishReason.FAILED, error)
        if stopped_outside(seg, s.sampling.stop_token_ids):
            if s.cancelled:
                return s.to_sample(FinishReason.CANCELLED)
            s.segment += 1  # the model's EOS, not the caller's stop: the sample goes on
            self._submit(s, s.drafter_version)
            return None
        reason, error = finish_reason(seg, cancelled=s.cancelled)
        self.counters["finished"] += 1
        return s.to_sample(reason, error)

    def cancel(self, request_id: str) -> None:
        assert self.engine is not None
        for s in [s for s in self.held if s.request_id == request_id]:
            self.held.remove(s)
            self.done.append(s.to_sample(FinishReason.CANCELLED))
        for s in self.running.values():
            if s.request_id == request_id and not s.cancelled:
                s.cancelled = True
                self.engine.abort(s.rid)  # it comes back from a later poll as an abort

    def abort_everything(self) -> list[Sample]:
        carried = self._suspend_all() + self.held
        self.held = []
        samples, self.done = self.done, []
        return samples + [s.to_sample(FinishReason.CANCELLED) for s in carried]

    def _suspend_all(self) -> list[_Running]:
        """Abort every request and wait for them; returns the samples cut short (with the
        tokens they had). Those that ended on their own meanwhile, or were being cancelled,
        go to `self.done`."""
        assert self.engine is not None
        if self.running:
            self.engine.abort_all()
        outs: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + ABORT_WAIT_SECONDS
        while self.running.keys() - outs.keys() and time.monotonic() < deadline:
            outs.update(self.engine.poll(POLL_SECONDS))
        carried = []
        for rid, s in self.running.items():
            if rid in outs:  # else it never answered: it keeps the tokens of earlier segments
                try:
                    seg = read_output(outs[rid])
                except ValueError as exc:
                    self.done.append(s.to_sample(FinishReason.FAILED, str(exc)))
                    continue
                s.absorb(seg)
                self.steps.add(seg)
                if seg.finish != "abort" and not stopped_outside(seg, s.sampling.stop_token_ids):
                    self.done.append(s.to_sample(*finish_reason(seg, cancelled=s.cancelled)))
                    continue
            if s.cancelled:
                self.done.append(s.to_sample(FinishReason.CANCELLED))
                continue
            s.segment += 1
            carried.append(s)
        self.running.clear()
        return carried

    # -- models ---------------------------------------------------------------------------

    def load(self, msg: LoadModel) -> None:
        self._stop_engine()  # free the device before the next model starts
        self.running.clear()
        self.held, self.broadcast, self.policy_source = [], None, ""
        self._drop_export()
        self._drop_adaptive()
        self.adaptive_path = self._write_adaptive(msg.engine)
        args = engine_args(msg.engine, msg.path, "", self.adaptive_path, msg.policy_version)
        self.engine = self.factory(args)
        self.spec, self.args = msg.engine, args
        self.policy_path, self._policy_version = msg.path, msg.policy_version
        self.counters.clear()
        self.steps = StepCounters()

    def load_policy(self, path: str, version: int) -> None:
        assert self.engine is not None
        b = self.broadcast
        if b is not None and b.path == path and not b.received:
            self._wait_received(VERSION_WAIT_SECONDS)  # the daemon may be ahead by a tensor
            b = self.broadcast
        if b is not None and not b.received:
            if b.path == path:
                return  # the engine is mid-update: the daemon offers the version again later
            self._abandon(b, path, version)
            return
        if b is not None and b.path == path:
            # The engine already holds these weights: the version only names them now.
            self.engine.set_weight_version(str(version))
            self.policy_source = "broadcast"
        else:
            # A later restart starts from these weights.
            args = self.args | {"model_path": path, "weight_version": str(version)}
            if not self.engine.update_weights(WeightUpdate(path, "target", str(version))):
                self._restart(args, _eagle_version(args, self.drafter_version))
            self.policy_source = ""
        self.args = self.args | {"model_path": path, "weight_version": str(version)}
        self.policy_path, self._policy_version = path, version
        if b is not None:
            self._end_broadcast()

    # -- a policy broadcast (see the module docstring) ------------------------------------

    def join_broadcast(self, m: JoinBroadcast) -> None:
        if self.engine is None or (self.broadcast is not None and not self.broadcast.received):
            # Its ranks are counted in the group: the broadcast fails, the trainer pushes.
            self.errors.append(f"policy broadcast to {m.path} not joined: the engine is busy")
            return
        carried = self._suspend_all()
        for s in carried:
            # The weights change under it: started again, every token of the sample comes
            # from one recorded version, the one it then reports. (The daemon sends a join
            # only to an idle SGLang worker; this covers work that arrived on the way.)
            s.start_over()
        self.held += carried
        self.engine.start_broadcast(distributed_join(m))
        self.broadcast = _Broadcast(m.path, m.timeout_seconds)

    def _advance_broadcast(self) -> None:
        assert self.engine is not None and self.broadcast is not None
        b = self.broadcast
        if not b.received:
            result = self.engine.broadcast_result()
            if result is None:
                return  # SGLang's own group timeout bounds a receive
            ok, message = result
            if not ok:
                self._restore(f"policy broadcast to {b.path} failed: {message}")
                return
            b.received, b.deadline = True, time.monotonic() + b.timeout
        elif time.monotonic() >= b.deadline:
            self._restore(
                f"policy broadcast to {b.path} was not recorded within {b.timeout:.0f} s "
                f"of its arrival: back to policy version {self._policy_version}"
            )
        else:
            time.sleep(POLL_SECONDS)  # nothing runs until the LoadPolicy: do not spin

    def _wait_received(self, seconds: float) -> None:
        assert self.engine is not None and self.broadcast is not None
        deadline = time.monotonic() + seconds
        while not self.broadcast.received and time.monotonic() < deadline:
            self.done += self._poll(POLL_SECONDS)
            self._advance_broadcast()
            if self.broadcast is None:
                return

    def _abandon(self, b: _Broadcast, path: str, version: int) -> None:
        """Another version was recorded while the engine still waits in the broadcast's group
        (its trainer gave up and pushed by gRPC, or never came): SGLang would wait there for
        torch's group timeout (30 minutes), so the engine restarts on that version."""
        self.errors.append(
            f"policy broadcast to {b.path} abandoned: policy version {version} was recorded "
            "while the engine still waited in its group; the engine restarts"
        )
        args = self.args | {"model_path": path, "weight_version": str(version)}
        self.broadcast = None
        try:
            self._restart(args, _eagle_version(args, self.drafter_version))
            self.args, self.policy_path, self._policy_version = args, path, version
            self.policy_source = ""
        finally:
            # The held samples go on whatever the restart did: on the engine that runs now
            # (the new one, or the old one started again), or fail when none does.
            if self.engine is None:
                held, self.held = self.held, []
                why = "the engine did not start again"
                self.done += [s.to_sample(FinishReason.FAILED, why) for s in held]
            self._end_broadcast()

    def _restore(self, error: str) -> None:
        """Back to the recorded version's weights (the file), then the held samples go on."""
        assert self.engine is not None
        self.errors.append(error)
        version = str(self._policy_version)
        self.engine.update_weights(WeightUpdate(self.policy_path, "target", version))
        self._end_broadcast()

    def _end_broadcast(self) -> None:
        self.broadcast = None
        held, self.held = self.held, []
        self._resume(held, _eagle_version(self.args, self.drafter_version))

    def set_drafter(self, path: str, version: int) -> int:
        assert self.engine is not None
        if self.broadcast is not None:
            return self.drafter_version  # after the broadcast: the daemon offers it again
        export = self._export(path) if path else ""
        args = engine_args(
            self.spec, self.policy_path, export, self.adaptive_path, self._policy_version
        )
        try:
            # In place only from one EAGLE drafter to another: anything else (NGRAM or none
            # before, none after) changes the engine's speculative algorithm.
            eagle_to_eagle = _eagle_version(self.args, 1) == _eagle_version(args, 1) == 1
            update = WeightUpdate(export, "draft", str(self._policy_version))
            in_place = eagle_to_eagle and self.engine.update_weights(update)
            if not in_place and args != self.args:
                self._restart(args, _eagle_version(args, version))
        except BaseException:
            if export:
                shutil.rmtree(export, ignore_errors=True)
            raise
        self._drop_export()
        self.export_dir, self.args = export, args
        if in_place:  # running samples continue with the new drafter
            for s in self.running.values():
                s.drafter_version = _eagle_version(args, version)
        return version if path else 0

    def _export(self, drafter_dir: str) -> str:
        """Our drafter checkpoint -> an SGLang EAGLE checkpoint in a fresh directory."""
        from tltd_workers.drafter.versions import export_sglang

        out = tempfile.mkdtemp(prefix="tltd-sglang-drafter-")
        try:
            # No embeddings: SGLang's EAGLE draft model uses the target's embed and head, and
            # copying them would read the whole target checkpoint.
            export_sglang(drafter_dir, self.policy_path, out, include_embeddings=False)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out

    def _write_adaptive(self, spec: EngineSpec) -> str:
        """The job's `speculative_adaptive_config` in a file of this worker ("" when off)."""
        if spec.spec_mode == "off":
            return ""
        out = tempfile.mkdtemp(prefix="tltd-sglang-adaptive-")
        path = f"{out}/adaptive.json"
        with open(path, "w") as f:
            json.dump(adaptive_config(spec), f)
        return path

    def _drop_adaptive(self) -> None:
        if self.adaptive_path:
            shutil.rmtree(self.adaptive_path.rsplit("/", 1)[0], ignore_errors=True)
            self.adaptive_path = ""

    def _restart(self, args: dict[str, Any], eagle_version: int) -> None:
        """Restart the engine with `args`, carrying the running samples over. When the new
        engine does not start, the old arguments are started again (the work goes on) and
        the error is raised; when that fails too, nothing is loaded any more."""
        carried = self._suspend_all()
        self._stop_engine()
        try:
            self.engine = self.factory(args)
        except Exception:
            try:
                self.engine = self.factory(self.args)
            except Exception as exc:
                self.done += [s.to_sample(FinishReason.FAILED, describe(exc)) for s in carried]
                self.job_id = ""  # the daemon then loads the job again from scratch
                raise
            self._resume(carried, _eagle_version(self.args, self.drafter_version))
            raise
        self.counters["restarts"] += 1
        self._resume(carried, eagle_version)

    def _resume(self, carried: list[_Running], eagle_version: int) -> None:
        for s in carried:
            self._submit(s, eagle_version)

    def _stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass  # it is gone either way; a device still held fails the next start loudly

    def _drop_export(self) -> None:
        if self.export_dir:
            shutil.rmtree(self.export_dir, ignore_errors=True)
            self.export_dir = ""

    def close(self) -> None:
        self._stop_engine()
        self._drop_export()
        self._drop_adaptive()
