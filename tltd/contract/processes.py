"""How the daemon starts its worker processes (rollout workers, drafter trainers).

A forkserver that imported torch and the workers' modules once forks each worker, instead of a
fresh interpreter importing torch again for every (re)start: on a 2-core CPU that import is
about 1.1 s of a worker's start, paid again after every preemption, crash or backend switch.
A fork of the forkserver gets the forkserver's environment, not the daemon's at that moment,
so each worker first takes the daemon's environment as it was when the worker was started,
as a spawned process would have.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

# Imported once in the forkserver, in this order (the first makes it ignore stop signals); a
# module that cannot be imported there (no torch in this environment) is skipped by
# multiprocessing and imported by the worker itself.
PRELOAD = [
    "tltd_workers.forkserver",
    "torch",
    "tltd_workers.rollout.worker",
    "tltd_workers.engine.engine",
]


def worker_context() -> Any:
    """The multiprocessing context for worker processes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts
    return ctx


def with_environment(target: Callable[..., None], *args: Any) -> tuple[Callable, tuple]:
    """`ctx.Process(target=..., args=...)` arguments that run `target(*args)` in the daemon's
    current environment."""
    return _run_in, (dict(os.environ), target, *args)


def _run_in(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)
