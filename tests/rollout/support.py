"""Helpers for the rollout tests: tiny random HF checkpoints and a worker process on a pipe."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tests.api.support import TEST_COST_BUDGET_SECONDS
from tltd.supervisor.worker_process import Phase

VOCAB = 48


def make_checkpoint(path: Path, *, seed: int = 0, vocab: int = VOCAB, hidden: int = 32) -> Path:
    """A random 2-layer Qwen2 saved in HF layout (config.json + model.safetensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Room for the daemon tests' long requests (prompt + 1000 new tokens): admission
        # refuses a context beyond the model's positions.
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # HF init is tiny: make outputs depend on the context
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    return path


def direct_outputs(
    path: Path, prompts, sampling, speculative: bool = True, max_seq_len: int = 1024
) -> dict:
    """What the engine produces in-process: {(prompt, sample): token ids}. Computed once per
    checkpoint (as its files are now), prompts and sampling: many tests compare with the same
    reference, and a long one takes seconds."""
    files = tuple(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(path).iterdir())
    )
    key = (str(Path(path).resolve()), files, tuple(map(tuple, prompts)), sampling, speculative,
           max_seq_len)  # fmt: skip
    if key not in _DIRECT:
        _DIRECT[key] = _direct_outputs(path, prompts, sampling, speculative, max_seq_len)
    return dict(_DIRECT[key])


_DIRECT: dict[tuple, dict] = {}


def _direct_outputs(path: Path, prompts, sampling, speculative: bool, max_seq_len: int) -> dict:
    from tltd_workers.engine.engine import Engine, EngineConfig, Request

    engine = Engine(path, EngineConfig(max_batch=16, max_seq_len=max_seq_len))
    outs = engine.generate(
        Request(f"r{i}", p, sampling, prompt_index=i, speculative=speculative)
        for i, p in enumerate(prompts)
    )
    return {(o.prompt_index, o.sample_index): tuple(o.token_ids) for o in outs}


class WorkerProcess:
    """A real rollout worker process (spawn), driven directly over its pipe."""

    def __init__(self, heartbeat_seconds: float = 0.2) -> None:
        from tltd_workers.rollout.worker import main

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, 1, heartbeat_seconds), daemon=True)
        self._pending: list = []
        self.proc.start()
        child.close()

    def send(self, msg) -> None:
        self.conn.send(msg)

    def recv(self, kind, timeout: float = 60.0, keep: list | None = None):
        """The next message of type `kind` (others are appended to `keep`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._pending and self.conn.poll(0.1):
                got = self.conn.recv()  # a list: messages sent together (a step's samples)
                self._pending.extend(got if isinstance(got, list) else [got])
            while self._pending:
                msg = self._pending.pop(0)
                if isinstance(msg, kind):
                    return msg
                if keep is not None:
                    keep.append(msg)
        raise TimeoutError(f"no {kind} within {timeout}s")

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


class InProcessDaemon:
    """The real daemon parts (`tltd.daemon.Daemon`: supervisor with real worker processes,
    gRPC server on port 0, periodic jobs) on an event loop in a thread, so that tests use the
    synchronous client and can look inside the supervisor."""

    def __init__(self, settings, store, nvml=None) -> None:
        import asyncio
        import threading

        self.settings = settings
        self.store = store
        self.nvml = nvml  # a fake `tltd.devices.Nvml` for GPUs; None: the CPU slots
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.daemon = None

    def start(self) -> InProcessDaemon:
        from tltd.daemon import Daemon

        self._thread.start()

        async def start():
            self.daemon = Daemon(self.settings, self.store, self.nvml)
            await self.daemon.start()

        self.call(start())
        return self

    def call(self, coro, timeout: float = 120.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def supervisor(self):
        return self.daemon.supervisor

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.daemon.api.port}"

    def client(self):
        from tltd_clients.client import TltClient

        return TltClient(self.target)

    def wait_workers_ready(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            handles = list(self.supervisor.handles.values())
            if len(handles) >= n and all(s.phase is Phase.READY and s.job_id for s in handles):
                return
            time.sleep(0.05)
        raise TimeoutError("workers not ready")

    def shutdown(self) -> None:
        """The daemon's own ordered shutdown (drain within the grace, then stop)."""
        if self.daemon is not None:
            self.call(self.daemon.shutdown(), timeout=self.settings.shutdown_grace_seconds + 60)
            self.daemon = None
        self.close()

    def kill(self) -> None:
        """Stop without draining (what is open stays open in the store, like a crash)."""
        if self.daemon is not None:
            d = self.daemon

            async def step(name: str, aw) -> None:
                # A step that hangs is named, with where it waits, read before it is
                # cancelled (once cancelled, what it waited on is gone from the dump).
                task = asyncio.ensure_future(aw)
                done, _ = await asyncio.wait({task}, timeout=60.0)
                if not done:
                    where = _where_it_waits()
                    task.cancel()
                    raise TimeoutError(f"killing the daemon: {name} did not end in 60 s\n{where}")
                task.result()

            async def stop():
                if d.training is not None:  # drafter trainers die with the daemon too
                    await step("the drafter trainers' abort", d.training.abort())
                await step("the gRPC server's stop", d.api.stop(0))
                if d.scheduler is not None:
                    d.scheduler.shutdown(wait=False)
                # Workers killed at once, not asked to exit: their own exit takes seconds on a
                # loaded machine, and a crash does not wait for it either.
                await step("the supervisor's stop", d.supervisor.stop(time.monotonic()))
                # What else dies with the process: its listener, its other ports.
                if d.listener is not None:
                    await step("the listener's stop", asyncio.to_thread(d.listener.stop))
                if d.http is not None:
                    await step("the HTTP door's stop", d.http.stop(0))
                if d.metrics is not None:
                    d.metrics.stop()

            self.call(stop())
            self.daemon = None
        self.close()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


class ServeProcess:
    """`python -m tltd serve` as a real subprocess (port 0, JSON logs to a file)."""

    def __init__(
        self,
        tmp_path: Path,
        db_url: str,
        name: str = "tltd",
        cpu_slots: int = 2,
        start_timeout: float = 60.0,
        **env: str,
    ) -> None:
        import os
        import subprocess
        import sys

        root = Path(__file__).resolve().parents[2]
        self.port_file = tmp_path / f"{name}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_file = tmp_path / f"{name}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        base |= {
            "PYTHONPATH": str(root),
            "TLTD_WORKER_MAX_BATCH": "16",
            "TLTD_WORKER_MAX_SEQ_LEN": "1024",
            "TLTD_WORKER_HEARTBEAT_SECONDS": "0.2",
            "TLTD_DEVICE_REFRESH_SECONDS": "3600",
            "TLTD_WORKER_COST_BUDGET_SECONDS": str(TEST_COST_BUDGET_SECONDS),
        } | {f"TLTD_{k.upper()}": str(v) for k, v in env.items()}
        cmd = [
            sys.executable, "-m", "tltd", "serve", "--port", "0",
            "--port-file", str(self.port_file), "--data-dir", str(tmp_path / "data"),
            "--database-url", db_url, "--cpu-slots", str(cpu_slots), "--log-json",
        ]  # fmt: skip
        self._log = open(self.log_file, "w")  # noqa: SIM115 - closed in wait()
        # Its own process group: a test may signal the whole group (Ctrl-C, systemd's stop).
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=base, stdout=self._log, stderr=self._log, start_new_session=True
        )
        deadline = time.monotonic() + start_timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"tltd did not start:\n{self.log_file.read_text()}")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{int(self.port_file.read_text())}"

    def client(self):
        from tltd_clients.client import TltClient

        return TltClient(self.target)

    def wait_workers_ready(self, job_id: str = "", n: int = 2, timeout: float = 60.0) -> list:
        """Until `n` rollout workers are ready with a model (of `job_id`, when given)."""
        with self.client() as c:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                ws = [w for w in c.list_workers() if w.kind == "rollout"]
                ok = [w for w in ws if w.state == "ready" and w.job_id == (job_id or w.job_id)]
                if len(ws) == n and len(ok) == n and all(w.job_id for w in ws):
                    return ws
                time.sleep(0.1)
        raise TimeoutError(f"workers not ready:\n{self.log_file.read_text()[-3000:]}")

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """kill -9 of the daemon and its workers (its process group): workers left to notice
        their daemon is gone would spend the next test's CPU on their exit."""
        import os
        import signal
        from contextlib import suppress

        if self.proc.poll() is None:
            with suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def logs(self) -> list[dict]:
        import json

        return [
            json.loads(line)
            for line in self.log_file.read_text().splitlines()
            if line.startswith("{")
        ]


def wait_until(cond, timeout: float = 30.0, what: str | Callable[[], str] = "condition") -> None:
    """Until `cond()`; past `timeout`, TimeoutError saying `what` (called then, when it is a
    function: what the state was at the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise TimeoutError(what() if callable(what) else what)


def pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its dead parent's reaper) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def reference_logprobs(path, prompt: list[int], tokens: list[int]):
    """Logprobs of `tokens` after `prompt` under the transformers model at `path`, and the
    model's argmax at each of those positions."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt + tokens])).logits[0], -1)
    at = logp[len(prompt) - 1 : -1]
    return at.gather(-1, torch.tensor(tokens)[:, None])[:, 0], at.argmax(-1)


def _where_it_waits() -> str:
    """Every thread's stack and every task of the running loop: what a stop that hangs waits
    on."""
    import io
    import sys
    import threading
    import traceback

    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {names.get(ident, ident)}\n")
        out.write("".join(traceback.format_stack(frame)[-6:]))
    for task in asyncio.all_tasks():
        out.write(f"--- task {task.get_name()}\n")
        awaited = task.get_coro()  # the chain of awaits, innermost last
        while awaited is not None and hasattr(awaited, "cr_frame"):
            frame = awaited.cr_frame
            if frame is not None:
                out.write(f"    {frame.f_code.co_qualname} ({frame.f_code.co_filename}:"
                          f"{frame.f_lineno})\n")  # fmt: skip
            awaited = getattr(awaited, "cr_await", None)
        if awaited is not None:
            out.write(f"    awaits {awaited!r}\n")
    return out.getvalue()
