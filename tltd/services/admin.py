"""Operator use cases: devices, workers, cordon / uncordon / drain, node statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import tltd
from tltd.domain import Device, Node, Stats, Worker
from tltd.errors import InvalidArgument
from tltd.services.node import NodeState
from tltd.services.validation import MAX_REASON, check_id, check_text

if TYPE_CHECKING:
    from tltd.store import Store


class AdminService:
    def __init__(self, store: Store, node: NodeState, down_seconds: float = 10.0) -> None:
        self.store = store
        self.node = node
        self.down_seconds = down_seconds  # settings.node_down_seconds

    def list_nodes(self) -> list[Node]:
        """Every daemon on the database; DOWN when its heartbeat is older than the threshold."""
        return self.store.nodes.list(self.down_seconds)

    def list_devices(self) -> list[Device]:
        return self.store.devices.list()

    def list_workers(self, device_id: str = "") -> list[Worker]:
        if device_id:
            self.store.devices.get(device_id)  # NotFound rather than a silent empty list
        return self.store.workers.list(device_id=device_id or None)

    def cordon(self, device_id: str, reason: str = "") -> Device:
        """No new work is placed on the device; what runs there keeps running."""
        self._check_device_id(device_id)
        check_text(reason, "reason", MAX_REASON)
        return self.store.devices.set_flags(
            device_id, cordoned=True, reason=reason or "cordoned by operator"
        )

    def uncordon(self, device_id: str) -> Device:
        """Make the device schedulable again (clears both cordon and a device-level drain)."""
        self._check_device_id(device_id)
        return self.store.devices.set_flags(
            device_id, cordoned=False, draining=False, reason="uncordoned by operator"
        )

    def cordon_node(self, node_id: str, reason: str = "") -> list[Device]:
        """Cordon every device of a node (this one or another of the database)."""
        check_id(node_id, "node_id")
        check_text(reason, "reason", MAX_REASON)
        return self.store.nodes.set_cordon(node_id, True, reason or "node cordoned by operator")

    def uncordon_node(self, node_id: str) -> list[Device]:
        check_id(node_id, "node_id")
        return self.store.nodes.set_cordon(node_id, False, "node uncordoned by operator")

    def drain(
        self,
        device_id: str = "",
        node: bool = False,
        reason: str = "",
        grace_seconds: float = 0,
        node_id: str = "",
    ) -> list[Device]:
        """Mark one device, or with node=True every device and the daemon, as draining.

        A drained device takes no new work; what runs there finishes (no grace).

        A draining node refuses new rollouts (UNAVAILABLE) so trainers go elsewhere; work in
        flight finishes within `grace_seconds` (0: the daemon's drain_grace_seconds), then
        comes back partial (or, with other nodes up, is handed over to them). `node_id` names
        another node of the database: the request goes through the store, and that node
        starts draining at the notification or its next heartbeat.
        """
        check_text(reason, "reason", MAX_REASON)
        if node_id and not node:
            raise InvalidArgument("applies to a node drain (node=true) only", field="node_id")
        if node:
            if device_id:
                raise InvalidArgument(
                    "give either device_id or node=true, not both", field="device_id"
                )
            reason = reason or "node drained by operator"
            if node_id and node_id != self.store.node_id:
                check_id(node_id, "node_id")
                return self.store.nodes.request_drain(node_id, reason, grace_seconds)
            self.node.start_draining(reason, grace_seconds or None)
            return [
                self.store.devices.set_flags(d.device_id, draining=True, reason=reason)
                for d in self.store.devices.list()
            ]
        self._check_device_id(device_id)
        if grace_seconds:
            raise InvalidArgument(
                "applies to a node drain only: a drained device takes no new work and lets what "
                "runs there finish",
                field="grace_seconds",
            )
        reason = reason or "drained by operator"
        return [self.store.devices.set_flags(device_id, draining=True, reason=reason)]

    def stats(self) -> Stats:
        s = self.store.history.stats()
        devices = self.store.devices.list()
        return Stats(
            version=tltd.__version__,
            uptime_seconds=self.node.uptime_seconds(),
            database=self.store.dialect,
            devices=len(devices),
            devices_schedulable=sum(d.schedulable for d in devices),
            workers=len(self.store.workers.list()),
            jobs_active=s["jobs_active"],
            requests_by_status=dict(s["requests_by_status"]),
            samples_total=s["samples_total"],
            tokens_generated=s["tokens_generated"],
            mean_accepted_length=s["mean_accepted_length"],
            draining=self.node.draining,
        )

    @staticmethod
    def _check_device_id(device_id: str) -> None:
        """DEVICE on this node, or NODE/DEVICE on any node of the database: its daemon reads
        the flags at its next scheduling tick."""
        node, slash, device = device_id.rpartition("/")
        if slash:
            check_id(node, "device_id")
        check_id(device, "device_id")
