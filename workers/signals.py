"""Signals in worker processes: the daemon alone decides when its workers stop."""

from __future__ import annotations

import signal


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM (first thing in a worker process). Ctrl-C in a terminal and
    systemd's stop (KillMode=control-group) signal every process of the daemon at once; workers
    killed then could not return their partial samples, nor the trainer write its checkpoint,
    during the daemon's drain. The daemon stops its workers through their pipe (and SIGKILL
    after its deadline); a worker whose daemon is gone sees its pipe close and exits. Child
    processes of the worker (SGLang's) inherit the ignored signals."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
