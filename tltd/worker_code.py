"""The worker code the daemon's processes run: their entry points and what the forkserver
preloads. The one module of the daemon that names `tltd_workers`, inside the functions that
start a process.

A forkserver that imported torch and the workers' modules once forks each worker, instead of a
fresh interpreter importing torch again for every (re)start: on a 2-core CPU that import is
about 1.1 s of a worker's start, paid again after every preemption, crash or backend switch.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from tltd.domain import Backend

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
    """The multiprocessing context for worker processes (rollout workers, drafter trainers)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts
    return ctx


def start_forkserver() -> None:
    """Start the forkserver now (it returns at once): its imports (torch, ~2.5 s on a 2-core
    CPU) then run beside the daemon's own start (imports, migrations, joining) instead of
    holding up the first worker's start, and with it the daemon's first answer."""
    from multiprocessing import forkserver

    worker_context()
    forkserver.ensure_running()


def rollout_entry(backend: Backend) -> tuple[Callable[..., None], bool]:
    """The process target of a backend's rollout worker, and whether the process may be
    daemonic: SGLang's engine starts its own scheduler processes, which a daemonic process
    may not have (they die with it through SGLang's parent-death signal instead)."""
    if backend is Backend.SGLANG:
        from tltd_workers.rollout.sglang_worker import main as sglang_main

        return sglang_main, False
    if backend is Backend.SIM:
        from tltd_workers.rollout.sim_worker import main as sim_main

        return sim_main, True
    from tltd_workers.rollout.worker import main as torch_main

    return torch_main, True


def trainer_entry() -> Callable[..., None]:
    """The process target of a drafter trainer (light to import: torch loads in the process)."""
    from tltd_workers.drafter.trainer_process import main

    return main
