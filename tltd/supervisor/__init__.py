"""The supervisor: rollout worker processes, their health, live requests and the scheduling tick.

`supervisor` holds the `Supervisor` (lifecycle, the tick, the rollout API); the other modules are
its parts: `rollout_workers`, `worker_process` and `worker_pipe` (the worker processes),
`live_requests` and `work_queue` (the requests live here), `lease_keeper` (this node's work
leases), `parking` (step bounds), `freezes` (jobs paused in place), `drain`, `model_planner`,
`snapshot` and `tick_state` (what a tick decides on), `fair_share`, `policy_updates`, `writes`,
and `training_hook` (the seam to drafter training).
"""

from tltd.supervisor.live_requests import StreamEvent
from tltd.supervisor.supervisor import Supervisor
from tltd.supervisor.training_hook import TrainingHook

__all__ = ["StreamEvent", "Supervisor", "TrainingHook"]
