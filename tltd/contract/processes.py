"""How a worker process takes the daemon's environment: run in the process, so on the floor.

The daemon's worker processes are forks of a forkserver (`tltd.worker_code`), which gets the
forkserver's environment, not the daemon's at that moment; each worker therefore first takes the
daemon's environment as it was when the worker was started, as a spawned process would have.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def with_environment(target: Callable[..., None], *args: Any) -> tuple[Callable, tuple]:
    """`ctx.Process(target=..., args=...)` arguments that run `target(*args)` in the daemon's
    current environment."""
    return _run_in, (dict(os.environ), target, *args)


def _run_in(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)
