"""The drafter-training process's entry point: what the daemon's `TrainerProcess` starts.

Light at import (the daemon names it without loading torch); the process itself imports torch and
its loop (`training_loop.py`) once it runs.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection

from tltd.contract import drafter_messages as proto
from tltd.contract.drafter_messages import TrainerSpec
from tltd_workers.signals import ignore_stop_signals


def main(spec: TrainerSpec, conn: Connection) -> None:
    """Process entry point (a worker process: `tltd.contract.processes`)."""
    ignore_stop_signals()
    if spec.nice:
        os.nice(spec.nice)
    loop = None
    try:
        import torch

        from tltd_workers.drafter.training_loop import TrainingLoop

        torch.set_num_threads(spec.threads)
        loop = TrainingLoop(spec, conn)
        loop.run()
    except BaseException:
        error = traceback.format_exc()
        if loop is not None:
            loop.send(proto.Failed(error))  # under its lock: the heartbeat thread sends too
        else:
            conn.send(proto.Failed(error))
        raise
