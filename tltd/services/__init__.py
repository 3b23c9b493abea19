"""Use cases over the store and settings: plain domain objects in and out, no transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tltd.services.admin import AdminService
from tltd.services.broadcast import BroadcastService
from tltd.services.drafters import DrafterService
from tltd.services.jobs import JobService, NewJob
from tltd.services.node import NodeState
from tltd.services.pause import PauseMode, PauseService
from tltd.services.policy import PolicyService
from tltd.services.push import PushService
from tltd.services.rollouts import RolloutService
from tltd.services.sessions import SessionService
from tltd.services.weight_groups import WeightGroupService
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.supervisor import Supervisor

__all__ = [
    "AdminService",
    "BroadcastService",
    "DrafterService",
    "JobService",
    "NewJob",
    "NodeState",
    "PauseMode",
    "PauseService",
    "PolicyService",
    "PushService",
    "RolloutService",
    "Services",
    "SessionService",
    "WeightGroupService",
    "build_services",
]


@dataclass(frozen=True)
class Services:
    jobs: JobService
    rollouts: RolloutService
    policy: PolicyService
    pushes: PushService
    broadcasts: BroadcastService
    drafters: DrafterService
    admin: AdminService
    node: NodeState
    pauses: PauseService
    weight_groups: WeightGroupService
    sessions: SessionService


def build_services(
    store: Store,
    settings: Settings,
    node: NodeState | None = None,
    supervisor: Supervisor | None = None,
) -> Services:
    """Without a supervisor (API-only tests) Generate answers UNIMPLEMENTED."""
    node = node or NodeState()
    policy = PolicyService(store, supervisor)
    pushes = PushService(store, settings, policy)
    rollouts = RolloutService(store, settings, node, supervisor)
    apply = supervisor.apply_pauses if supervisor is not None else None
    rollouts.pauses = pauses = PauseService(store, rollouts.cancel, apply)
    return Services(
        jobs=JobService(store, settings, supervisor),
        rollouts=rollouts,
        policy=policy,
        pushes=pushes,
        broadcasts=BroadcastService(pushes, settings, supervisor),
        drafters=DrafterService(store),
        admin=AdminService(store, node, settings.node_down_seconds),
        node=node,
        pauses=pauses,
        weight_groups=WeightGroupService(store, pushes),
        sessions=SessionService(
            store, settings, rollouts, supervisor.queue.pins if supervisor is not None else None
        ),
    )
