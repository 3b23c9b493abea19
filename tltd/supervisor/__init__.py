"""The supervisor: rollout worker processes, their health, live requests and the scheduling tick.

`supervisor` holds the `Supervisor` (lifecycle, the tick, the rollout API); the other modules are
its parts: `rollout_workers` and `worker_process` (the worker processes), `live_requests` and
`work_queue` (the requests live here), `unit_leases` (this node's work leases), `parking` (step
bounds), `drain`, `model_planner`, `snapshot`, `writes`.
"""

from tltd.supervisor.live_requests import StreamEvent
from tltd.supervisor.supervisor import Supervisor
from tltd.supervisor.training_hook import TrainingHook

__all__ = ["StreamEvent", "Supervisor", "TrainingHook"]
