"""LeaseKeeper.release_excess: what a node no longer alone gives back to the others."""

from __future__ import annotations

from tltd.domain import Device, DeviceKind, RolloutRequest, SamplingParams
from tltd.settings import Settings
from tltd.supervisor.lease_keeper import LeaseKeeper
from tltd.supervisor.work_queue import RequestLedger
from tltd.supervisor.worker_process import Phase, WorkerHandle


class _Queue(list):
    def inflight(self, worker_id: str) -> int:
        return 0


class _Requests:
    """What release_excess calls: the units it loses here and releases to the queue."""

    def __init__(self, lives: list[RequestLedger]) -> None:
        self.queue = _Queue(lives)
        self.released: set[tuple[str, int]] = set()

    def lose_units(self, units, why):
        return []

    def release(self, units):
        self.released |= set(units)


def _live(rid: str, at: float, prompts: int, n: int = 4) -> RequestLedger:
    req = RolloutRequest(rid, "job", tuple((1, 2) for _ in range(prompts)), SamplingParams(n=n))
    pending = {p: list(range(n)) for p in range(prompts)}
    return RequestLedger(req, 0, at, pending, claims={p: p + 1 for p in range(prompts)})


def _leases(lives: list[RequestLedger], phase: Phase) -> tuple[LeaseKeeper, _Requests]:
    requests = _Requests(lives)
    handle = WorkerHandle("w0", Device("cpu:0", DeviceKind.CPU, 0), phase=phase)
    settings = Settings(worker_max_batch=4)
    leases = LeaseKeeper(None, settings, requests, {"w0": handle}, None)  # type: ignore[arg-type]
    return leases, requests


def test_units_beyond_the_free_slots_go_back_youngest_first_but_not_one_that_lost_a_worker():
    old, young = _live("old", 1.0, 2), _live("young", 2.0, 3)
    young.attempts[(2, 0)] = 1  # its sample (2, 0) was running on a worker that died
    leases, requests = _leases([old, young], Phase.READY)
    # 20 samples wait for 4 free slots: 16 too many, whole units of 4, youngest first; young's
    # unit 2 stays (it lost a worker: given back it could go from node to node for ever), so
    # what stays is that unit, which fills the free slots.
    assert leases.release_excess() == 4
    assert requests.released == {("young", 1), ("young", 0), ("old", 1), ("old", 0)}


def test_a_worker_loading_a_policy_keeps_its_slots():
    lives = [_live("r", 1.0, 1)]
    leases, requests = _leases(lives, Phase.LOADING)
    assert leases.release_excess() == 0 and not requests.released
