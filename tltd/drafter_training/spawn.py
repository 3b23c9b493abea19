"""What a drafter trainer process is started with: the one place the daemon names the drafter
trainer's own code (it runs in the process it spawns)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.drafter_training.runs import TrainerProcess, TrainerRun
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)


def import_trainer_code() -> None:
    """What `new_trainer` imports (torch with it), ahead of the first round (any thread)."""
    try:
        import tltd_workers.drafter.trainer  # noqa: F401
        import tltd_workers.drafter.trainer_process  # noqa: F401
    except Exception:  # the first round's import says why, where its failure is handled
        log.debug("trainer code not imported ahead", exc_info=True)


def new_trainer(
    store: Store, settings: Settings, root: Path, run: TrainerRun, active_drafter: int
) -> TrainerProcess:
    """A trainer process (not spawned yet) for `run`'s job, policy version and device: it
    resumes from this node's checkpoint, or a fresh one starts from the drafter the rollout
    workers use (`active_drafter`, 0: none) where this node can read it. Reads the store."""
    from tltd_workers.drafter.trainer import TrainerConfig
    from tltd_workers.drafter.trainer_process import TrainerProcess as Trainer
    from tltd_workers.drafter.trainer_process import TrainerSpec

    policy = store.get_policy_version(run.job_id, run.policy_version)
    run.policy_config = policy_config(policy.path)
    start_from, start_step = None, 0
    if active_drafter:
        dv = store.get_drafter(run.job_id, active_drafter)
        if dv.readable_on(store.node_id) and Path(dv.path).is_dir():
            start_from = dv.path
            start_step = dv.train_steps if run.taken_over else 0
    return Trainer(
        TrainerSpec(
            model_path=policy.path,
            checkpoint_dir=str(root / run.job_id / "train"),
            device=run.torch_device,
            trainer=TrainerConfig(row_len=settings.training_row_len),
            buffer_bytes=settings.training_buffer_bytes,
            keep_hidden=False,
            drafter_path=start_from,
            start_step=start_step,
            # Another node trained since this one's checkpoint: it is older than `start_from`.
            resume=not run.taken_over,
            threads=settings.worker_threads,
            heartbeat_seconds=settings.worker_heartbeat_seconds,
        )
    )


def policy_config(path: str) -> dict | None:
    """A policy checkpoint's config.json (None when it cannot be read: no in-place load)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
