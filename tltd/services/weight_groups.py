"""Policy weights broadcast in a group the trainer hosts, as SGLang's distributed weight update
works (slime, AReaL and SkyRL call it): the trainer is rank 0 and runs the TCP store; the
daemon joins as rank `rank_offset` (one rank: it hands the weights to its workers itself) and
keeps the group across updates. Each update announces tensors by name, dtype and shape and
the trainer broadcasts them in that order; the daemon writes them into a push
(`tltd.services.push`) of the job's whole tensor set, and once every tensor of the model has
arrived since the last version, the push is committed: checked, recorded as the job's next
policy version, loaded by the workers. A trainer that sends its weights in buckets (slime)
or one tensor per call (SkyRL) thus makes one version per full sync.

The group's keys are those SGLang's `init_custom_process_group` uses for its group name
(`tltd.contract.broadcast.group_prefix`), or another prefix the caller names (vLLM's weight
transfer: a trainer's default group). Gloo only: the daemon is a CPU process and cannot be an
NCCL rank. A trainer that builds an NCCL group instead gets that answer within a second or two,
not at the rendezvous timeout: an explicit NCCL backend is refused at once, and while the
daemon waits for the gloo rendezvous it watches the trainer's store for the NCCL id that vLLM's
weight-transfer engine (TRL's `init_communicator`) publishes there, whose message names no
backend.

vLLM's weight transfer brackets an update instead (`start` .. `update`s .. `finish`): the
version is committed at `finish` whatever arrived, the tensors not sent carried over from the
job's current version (vLLM updates the parameters it is sent and keeps the rest).
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tltd.domain import PolicyVersion, PushHeader, TensorSpec
from tltd.errors import FailedPrecondition, InvalidArgument, NotFound
from tltd.services.checkpoints import checkpoint_tensors
from tltd.services.validation import check_id
from tltd.staging import HeldTensors

if TYPE_CHECKING:
    from tltd.services.push import PushService, _Push
    from tltd.store import Store

log = logging.getLogger(__name__)

_MAX_TIMEOUT = 3600.0
# vLLM's StatelessProcessGroup publishes rank 0's first broadcast under this key of the trainer's
# store; its PyNcclCommunicator's first broadcast is the NCCL unique id. Present: the trainer is
# building vLLM's NCCL weight-transfer group, which the daemon's gloo rank will never meet.
_VLLM_NCCL_ID_KEY = "broadcast_from/0/0"
_PROBE_SECONDS = 0.1  # how often the join looks for it
NCCL_ANSWER = (
    "the daemon joins the trainer's weight group as a CPU rank, over gloo only (an NCCL group "
    "needs a CUDA rank). Host the group with gloo (torch.distributed with backend 'gloo'; "
    "SGLang's route: backend 'gloo'), or sync weights from a checkpoint: "
    "/update_weights_from_disk, or the tltd client's push"
)
# Trainers name dtypes as torch does, with or without the "torch." prefix.
_DTYPE_CODES = {v: k for k, v in TensorSpec.TORCH_DTYPES.items()}


@dataclass
class _Group:
    job_id: str
    name: str
    store: Any  # the trainer's TCPStore, as a client
    pg: Any  # this rank's gloo process group
    timeout: datetime.timedelta
    push: _Push | None = None  # the version being gathered
    received: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    bracketed: bool = False  # an update opened by `start`: committed by `finish` only


@dataclass(frozen=True)
class GroupUpdate:
    """What one update call did: tensors taken, and the version they completed (if any)."""

    received: int
    pending: int  # tensors of the model still missing for the next version
    version: PolicyVersion | None


class WeightGroupService:
    def __init__(self, store: Store, pushes: PushService) -> None:
        self.store = store
        self.pushes = pushes
        self._groups: dict[tuple[str, str], _Group] = {}
        self._lock = threading.Lock()

    def init_group(
        self,
        job_id: str,
        name: str,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_seconds: float = 300.0,
        prefix: str | None = None,
    ) -> None:
        """Join the trainer's group (blocks until every rank has joined, as SGLang's does);
        its keys are under `prefix` in the trainer's store (None: SGLang's for `name`)."""
        check_id(job_id, "job_id")
        _check_group_args(name, port, rank, world_size, backend, timeout_seconds)
        self.store.jobs.get(job_id)  # NotFound names the job
        key = (job_id, name)
        with self._lock:
            if key in self._groups:
                raise FailedPrecondition(
                    f"group {name!r} is open already: destroy it first", field="group_name"
                )
        import torch.distributed as dist

        from tltd.contract.broadcast import group_prefix

        timeout = datetime.timedelta(seconds=timeout_seconds)
        try:
            tcp = dist.TCPStore(address, port, world_size, False, timeout=timeout)
            keys = group_prefix(name) if prefix is None else prefix
            pg = _join_gloo(tcp, (address, port), keys, rank, world_size, timeout)
        except (RuntimeError, OSError, ValueError) as exc:
            raise FailedPrecondition(
                f"cannot join the trainer's group at {address}:{port}: {exc}",
                field="master_address",
            ) from exc
        with self._lock:
            self._groups[key] = _Group(job_id, name, tcp, pg, timeout)
        log.info("weights group joined", extra={"job_id": job_id, "rank": rank})

    def update(
        self,
        job_id: str,
        name: str,
        tensors: list[tuple[str, str, tuple[int, ...]]],
        note: str = "",
    ) -> GroupUpdate:
        """Receive `tensors` (name, torch dtype, shape) as rank 0 broadcasts them, in order;
        commit the version once the model's every tensor has arrived."""
        group = self._group(job_id, name)
        with group.lock:
            push = group.push or self._begin(group, note)
            specs = {s.name: s for s in push.header.tensors}
            wanted = [_spec(i, t, specs) for i, t in enumerate(tensors)]
            try:
                self._receive(group, push, wanted)
            except RuntimeError as exc:  # a rank died or timed out: the collective is broken
                self.destroy(job_id, name)
                raise FailedPrecondition(
                    f"the broadcast in group {name!r} failed ({exc}): the group is closed; "
                    "init it again and resend the weights",
                    field="group_name",
                ) from exc
            group.received.update(s.name for s, _ in wanted)
            missing = len(specs) - len(group.received)
            if missing or group.bracketed:
                return GroupUpdate(len(wanted), missing, None)
            group.push, group.received = None, set()
            self.pushes.detach(push)
            return GroupUpdate(len(wanted), 0, self.pushes.commit(push))

    def start(self, job_id: str, name: str) -> None:
        """Open a bracketed update (vLLM's start_weight_update): later `update`s gather into
        it and `finish` commits it. A half-gathered unbracketed update is dropped."""
        group = self._group(job_id, name)
        with group.lock:
            if group.bracketed:
                raise FailedPrecondition(
                    "an update is open already: finish it first", field="weight_update"
                )
            if group.push is not None:
                self.pushes.detach(group.push)
            group.push, group.received = None, set()
            self._begin(group, "")
            group.bracketed = True

    def finish(self, job_id: str, name: str, note: str = "") -> PolicyVersion:
        """Commit the open bracketed update as the job's next policy version: the tensors it
        received, and the job's current version's for the rest."""
        group = self._group(job_id, name)
        with group.lock:
            push = group.push
            if not group.bracketed or push is None:
                raise FailedPrecondition(
                    "no update is open: call /start_weight_update first", field="weight_update"
                )
            self._carry_over(group, push)
            group.push, group.received, group.bracketed = None, set(), False
            push.header = replace(push.header, note=note)
            self.pushes.detach(push)
            return self.pushes.commit(push)

    def _carry_over(self, group: _Group, push: _Push) -> None:
        """The tensors no update sent, copied from the job's current version."""
        rest = [s for s in push.header.tensors if s.name not in group.received]
        if not rest:
            return
        job = self.store.jobs.get(group.job_id)
        current = self.store.policies.get(group.job_id, job.policy_version)
        held = HeldTensors(Path(current.path))
        try:
            for s in rest:
                if held.spec(s.name) != (s.dtype, s.shape):
                    raise FailedPrecondition(
                        f"version {current.version} holds {s.name} as {held.spec(s.name)}, "
                        f"not {(s.dtype, s.shape)}: send it in the update",
                        field="update_info.names",
                    )
                self.pushes.store_tensor(push, s.name, held.read(s.name, 0, push.sizes[s.name]))
        finally:
            held.close()

    def destroy(self, job_id: str, name: str) -> bool:
        """Leave the group; a version half gathered is dropped. False when none was open."""
        with self._lock:
            group = self._groups.pop((job_id, name), None)
        if group is None:
            return False
        push, group.push, group.received = group.push, None, set()
        group.bracketed = False
        if push is not None:
            self.pushes.detach(push)  # left idle, the push service drops it
        return True

    def _group(self, job_id: str, name: str) -> _Group:
        with self._lock:
            group = self._groups.get((job_id, name))
        if group is None:
            raise NotFound(
                f"no weights group {name!r} for job {job_id}: join one first "
                "(/init_weights_update_group, /init_weight_transfer_engine)",
                field="group_name",
            )
        return group

    def _begin(self, group: _Group, note: str) -> _Push:
        """A push of the job's whole tensor set, as its model's checkpoint holds it."""
        job = self.store.jobs.get(group.job_id)
        headers = checkpoint_tensors(Path(job.model_path), "job")
        specs = tuple(
            TensorSpec(n, h["dtype"], tuple(h["shape"])) for n, h in sorted(headers.items())
        )
        update_id = f"group-{uuid.uuid4().hex[:16]}"
        group.push = self.pushes.attach(PushHeader(group.job_id, update_id, specs, note))
        return group.push

    def _receive(self, group: _Group, push: _Push, wanted) -> None:
        """Each tensor as broadcast, cast to the checkpoint's dtype, into the push."""
        import torch
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for spec, torch_dtype in wanted:
            t = torch.empty(spec.shape, dtype=getattr(torch, torch_dtype))
            group.pg.broadcast([t], opts).wait()
            stored = t.to(getattr(torch, TensorSpec.TORCH_DTYPES[spec.dtype])).contiguous()
            self.pushes.store_tensor(push, spec.name, stored.reshape(-1).view(torch.uint8).numpy())


def _join_gloo(
    tcp: Any, at: tuple[str, int], keys: str, rank: int, world: int, timeout: datetime.timedelta
) -> Any:
    """This rank's gloo group, joined in a thread while a second client of the trainer's store
    looks for vLLM's NCCL id: found, the join is abandoned (its thread ends at the rendezvous
    timeout, the group it may still make unused) and the trainer told at once."""
    import torch.distributed as dist

    from tltd.contract.broadcast import process_group

    # No world size: this client is not counted among the ranks the trainer's store waits for.
    probe = dist.TCPStore(at[0], at[1], None, False, timeout=timeout, wait_for_workers=False)
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            box["pg"] = process_group("gloo", tcp, keys, rank, world, timeout)
        except Exception as exc:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=join, name="weights-group-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_PROBE_SECONDS)
        if thread.is_alive() and probe.check([_VLLM_NCCL_ID_KEY]):
            raise FailedPrecondition(
                f"the trainer is building vLLM's NCCL weight-transfer group: {NCCL_ANSWER}",
                field="backend",
            )
    if "error" in box:
        raise box["error"]
    return box["pg"]


def _spec(i: int, t: tuple[str, str, tuple[int, ...]], specs: dict[str, TensorSpec]):
    """(the model's spec of tensor i, the torch dtype it is broadcast in)."""
    name, dtype, shape = t
    spec = specs.get(name)
    if spec is None:
        raise InvalidArgument(f"{name!r} is not a tensor of the job's model", field=f"names[{i}]")
    torch_dtype = dtype.removeprefix("torch.")
    if torch_dtype not in _DTYPE_CODES:
        raise InvalidArgument(f"{dtype!r}: one of {sorted(_DTYPE_CODES)}", field=f"dtypes[{i}]")
    if tuple(shape) != spec.shape:
        raise InvalidArgument(
            f"{name} is {spec.shape} in the job's model, not {tuple(shape)}", field=f"shapes[{i}]"
        )
    return spec, torch_dtype


def _check_group_args(
    name: str, port: int, rank: int, world_size: int, backend: str, timeout: float
) -> None:
    check_id(name, "group_name")
    if backend != "gloo":
        raise FailedPrecondition(f"backend {backend!r}: {NCCL_ANSWER}", field="backend")
    if not 0 < port < 65536:
        raise InvalidArgument("must be 1-65535", field="master_port")
    if not 0 < rank < world_size:
        raise InvalidArgument(
            f"must be 1..world_size-1 (the trainer is rank 0), got {rank}", field="rank_offset"
        )
    if not 0 < timeout <= _MAX_TIMEOUT:
        raise InvalidArgument(f"must be in (0, {_MAX_TIMEOUT:.0f}]", field="timeout")
