"""A torch rollout worker whose model loads end its process, as the OOM killer or a crash in a
native extension would: no LoadFailed, no traceback, just an exit (a spawn target for tests)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from tltd_workers.rollout import worker


def _die(*_args: object) -> None:
    os._exit(137)


def main(
    conn: Connection, threads: int = 1, heartbeat_seconds: float = 0.5, trace_dir: str = ""
) -> None:
    worker.RolloutWorker.load = _die
    worker.RolloutWorker.load_policy = _die
    worker.main(conn, threads, heartbeat_seconds, trace_dir)
