"""The supervisor: rollout worker processes, their health, live requests and the scheduling tick.

`supervisor` holds the `Supervisor` (lifecycle, the tick, the rollout API); the other modules are
its parts: `rollout_workers`, `worker_process`, `requests`, `model_planner`, `snapshot`, `writes`.
"""

from tltd.supervisor.live_requests import StreamEvent
from tltd.supervisor.supervisor import Supervisor
from tltd.supervisor.training_hook import TrainingHook

__all__ = ["StreamEvent", "Supervisor", "TrainingHook"]
