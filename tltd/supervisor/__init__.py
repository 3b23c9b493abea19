"""The supervisor: rollout worker processes, their health, live requests and the scheduling tick.

`supervisor` holds the `Supervisor` (lifecycle, tick, worker health); the other modules are its
parts: `worker_process`, `requests`, `models`, `snapshot`, `writes`.
"""

from tltd.supervisor.requests import StreamEvent
from tltd.supervisor.supervisor import Supervisor, TrainingHook

__all__ = ["StreamEvent", "Supervisor", "TrainingHook"]
