"""The simulated rollout worker: the shared worker loop over an engine that computes nothing.

For capacity planning: everything above the engine (the pipe, the supervisor, the store, the
stream) is the daemon's own code, and the engine costs what `tltd.contract.sim.SimConfig` says
(nothing, or a GPU-like step time spent asleep, using no CPU). Each sample's length is drawn
from the configured distribution or trace; its tokens and logprobs come from a seeded
generator over the model's vocabulary (only `config.json` is read: no weights, no torch).
Continuous batching as a real engine does it: at most `max_batch` samples decode together,
the rest wait; a step advances every running sample by one token, several steps at once when
nothing else could happen in between. Every sample it sends is marked `simulated`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from tltd.contract.lengths import new_token_cap
from tltd.contract.rollout_messages import AddWork, EngineSpec, LoadModel
from tltd.contract.sim import SimConfig, parse_sim
from tltd.domain import FinishReason, Sample
from tltd_workers.rollout.loop import WorkerLoop, serve
from tltd_workers.signals import ignore_stop_signals

# The longest one step sleeps: commands (cancel, drain) are read between steps.
SLICE_SECONDS = 0.02


def main(
    conn: Connection, threads: int = 1, heartbeat_seconds: float = 0.5, config: str = ""
) -> None:
    """Process entry point (multiprocessing spawn target). `threads` is unused: nothing is
    computed. `config` "": this node does not allow the simulated engine (every load fails)."""
    ignore_stop_signals()
    serve(conn, SimWorker(conn, heartbeat_seconds, parse_sim(config) if config else None))


@dataclass
class _Sim:
    """One sample: how many tokens it will have, how many it has so far."""

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_len: int
    length: int
    reason: FinishReason
    seed: str
    stops: tuple[int, ...]  # the request's stop ids
    stop: int | None  # the token a STOP sample ends with
    done: int = 0
    cancelled: bool = False

    @property
    def remaining(self) -> int:
        return self.length - self.done


@dataclass
class _Counters:
    steps: int = 0
    tokens: int = 0
    simulated_seconds: float = 0.0
    samples: int = 0
    lengths: list[int] = field(default_factory=list)  # a trace's lengths, once read


class SimWorker(WorkerLoop):
    """The shared loop over a simulated engine (see the module docstring)."""

    def __init__(
        self, conn: Connection, heartbeat_seconds: float, config: SimConfig | None
    ) -> None:
        super().__init__(conn, heartbeat_seconds)
        self.allowed = config is not None
        self.config = config or SimConfig()
        self.spec = EngineSpec()
        self.vocab = 0  # 0: nothing loaded
        self.eos: int | None = None
        self._policy_version = 0
        self.running: list[_Sim] = []
        self.waiting: deque[_Sim] = deque()
        self.counters = _Counters()
        if self.config.trace:
            text = Path(self.config.trace).read_text()
            self.counters.lengths = [int(x) for x in text.split() if x.strip()]

    # -- state ----------------------------------------------------------------------------

    def loaded(self) -> bool:
        return self.vocab > 0

    def policy_version(self) -> int:
        return self._policy_version if self.loaded() else 0

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self, msg: LoadModel) -> None:
        self.vocab = 0
        if not self.allowed:  # e.g. another node's job: only a node set to allow it runs one
            raise RuntimeError("sim_engine is not set on this node: it runs no simulated engine")
        config = json.loads((Path(msg.path) / "config.json").read_text())
        eos = config.get("eos_token_id")
        self.eos = eos[0] if isinstance(eos, list) and eos else eos
        self.spec = msg.engine
        self._policy_version = msg.policy_version
        self.vocab = int(config["vocab_size"])

    def load_policy(self, path: str, version: int) -> None:
        self._policy_version = version  # no weights: the version is all that changes

    def set_drafter(self, path: str, version: int) -> int:
        return 0  # nothing speculates

    def load_summary(self) -> tuple[int, int, dict[str, object]]:
        samples = [*self.running, *self.waiting]
        c = self.counters
        stats: dict[str, object] = {
            "backend": "sim",
            "simulated": True,
            "sim_steps": c.steps,
            "sim_tokens": c.tokens,
            "sim_seconds": round(c.simulated_seconds, 6),
            "sim_samples": c.samples,
        }
        return len(samples), sum(s.remaining for s in samples), stats

    # -- work -----------------------------------------------------------------------------

    def add(self, msg: AddWork) -> None:
        cap = new_token_cap(msg.sampling.max_new_tokens, len(msg.prompt_ids), self.spec.max_seq_len)
        if len(msg.prompt_ids) >= self.spec.max_seq_len:  # as the torch engine: no room left
            error = f"prompt of {len(msg.prompt_ids)} tokens >= max_seq_len {self.spec.max_seq_len}"
            self.fail(msg, msg.sample_indices, error)
            return
        stops = msg.sampling.stop_token_ids
        stop = stops[0] if stops else self.eos
        for i in msg.sample_indices:
            seed = (
                f"{self.config.seed}/{msg.sampling.seed}/{msg.prompt_index}/{i}"
                if msg.sampling.seed is not None
                else f"{self.config.seed}/{msg.request_id}/{msg.prompt_index}/{i}/{time.time()}"
            )
            drawn = self._length(random.Random(seed + "/length"))
            length, reason = (
                (cap, FinishReason.LENGTH) if drawn >= cap else (drawn, FinishReason.STOP)
            )
            prompt = len(msg.prompt_ids)
            sim = _Sim(
                msg.request_id, msg.prompt_index, i, prompt, length, reason, seed, stops, stop
            )
            self.waiting.append(sim)

    def _length(self, rng: random.Random) -> int:
        """An answer length (before the cap); a large number = runs to the cap."""
        c = self.config
        if self.counters.lengths:
            return max(1, rng.choice(self.counters.lengths))
        if c.median <= 0:
            return 1 << 62
        return max(1, round(c.median * rng.lognormvariate(0.0, c.sigma)))

    def cancel(self, request_id: str) -> None:
        for s in [*self.running, *self.waiting]:
            if s.request_id == request_id:
                s.cancelled = True

    def abort_everything(self) -> list[Sample]:
        out = [self._sample(s, FinishReason.CANCELLED) for s in [*self.running, *self.waiting]]
        self.running, self.waiting = [], deque()
        return out

    def step(self) -> list[Sample]:
        """Admit, advance every running sample by the same number of tokens (sleeping what
        those steps cost), return those that ended."""
        ended = self._take_cancelled()
        if ended:
            return ended
        prefill = self._admit()
        steps, seconds = self._advance(min(s.remaining for s in self.running))
        if prefill + seconds > 0:
            time.sleep(prefill + seconds)
        c = self.counters
        c.steps += steps
        c.tokens += steps * len(self.running)
        c.simulated_seconds += prefill + seconds
        for s in self.running:
            s.done += steps
        out = [self._sample(s, s.reason) for s in self.running if s.remaining <= 0]
        self.running = [s for s in self.running if s.remaining > 0]
        c.samples += len(out)
        return out

    def _take_cancelled(self) -> list[Sample]:
        gone = [s for s in [*self.running, *self.waiting] if s.cancelled]
        if gone:
            self.running = [s for s in self.running if not s.cancelled]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        return [self._sample(s, FinishReason.CANCELLED) for s in gone]

    def _admit(self) -> float:
        """Move waiting samples into the batch; the seconds their prefill costs."""
        tokens = 0
        while self.waiting and len(self.running) < self.spec.max_batch:
            s = self.waiting.popleft()
            self.running.append(s)
            tokens += s.prompt_len
        return tokens * self.config.prefill_us / 1e6

    def _advance(self, most: int) -> tuple[int, float]:
        """How many decode steps to take now (at most `most`, the next sample's end) and the
        seconds they cost: all of them when free, else as many as fit in one slice (>= 1)."""
        cfg = self.config
        if cfg.free:
            return most, 0.0
        rows = len(self.running)
        first = cfg.step_seconds(rows, sum(s.prompt_len + s.done for s in self.running))
        g = cfg.step_seconds(0, rows) - cfg.step_seconds(0, 0)  # each step adds a token a row
        # m steps cost m * first + g * m (m - 1) / 2: the largest m within one slice.
        if g > 0:
            b = first - g / 2
            fit = (math.sqrt(b * b + 2 * g * SLICE_SECONDS) - b) / g
        else:
            fit = SLICE_SECONDS / first if first > 0 else most
        steps = max(1, min(most, math.floor(fit)))
        return steps, steps * first + g * steps * (steps - 1) / 2

    def _sample(self, s: _Sim, reason: FinishReason) -> Sample:
        """The sample's tokens, drawn now from its seed: only the last of a STOP sample is its
        stop token (no other is one of the request's stop ids or the model's EOS)."""
        rng = random.Random(s.seed + "/tokens")
        avoid = {*s.stops, self.eos}
        ids = [rng.randrange(self.vocab) for _ in range(s.done)]
        for i, t in enumerate(ids):
            while t in avoid:  # (a vocabulary of stop ids alone is not a model)
                t = (t + 1) % self.vocab
            ids[i] = t
        if reason is FinishReason.STOP and ids and s.stop is not None:
            ids[-1] = s.stop
        logprobs = [-rng.expovariate(1.0) for _ in range(len(ids))]
        return Sample(
            s.request_id,
            s.prompt_index,
            s.sample_index,
            tuple(ids),
            tuple(logprobs),
            reason,
            policy_version=self.policy_version(),
            partial=reason not in (FinishReason.STOP, FinishReason.LENGTH),
            simulated=True,
        )
