"""A policy broadcast's group, as the trainer (the client), the daemon and its rollout workers
each join it: the keys it is found under in the daemon's TCP store, the ranks, and one rank's
receive. torch is imported only by the functions that join a group.

Every rank finds the group under the keys `group_prefix` names: those SGLang's
`init_weights_update_group` uses for the same group name (its `init_custom_process_group`: a
`tcp://` rendezvous, then torch's own group helper), so that an SGLang engine joins the same
group through its own API (tests/sglang_contract/).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from tltd.domain import TensorSpec

if TYPE_CHECKING:
    from torch import Tensor


TensorSpecs = Iterable[tuple[str, str, tuple[int, ...]]]  # (name, dtype code, shape), in order

# One rollout worker per device: an SGLang engine runs on one GPU. A broadcast gives an engine
# one rank per tensor-parallel GPU (SGLang joins as rank_offset + tp_rank), so the group's ranks
# follow this.
SGLANG_TP_SIZE = 1

# The trainer is rank 0; in the daemon's group (gloo) the daemon is rank 1, so the workers
# start at 2; in the workers' own group (nccl) they start at 1.
FIRST_WORKER_RANK = 2


def group_prefix(group_name: str, backend: str = "gloo") -> str:
    """The store prefix (for one `PrefixStore`) of group `group_name`'s keys as torch builds
    them for a group made by a `tcp://` rendezvous plus `PrefixStore(group_name)`, as SGLang
    does: its helper adds "<group_name>/" and then "<device>/" for the backend's first
    device ("cpu" for gloo, "cuda" for nccl); PrefixStore joins with "/"."""
    device = "cuda" if backend == "nccl" else "cpu"
    return f"{group_name}/{group_name}//{device}/"


def default_group_prefix(backend: str = "gloo") -> str:
    """The store prefix of the default group torch.distributed.init_process_group makes from
    a `tcp://` rendezvous, when it is the process's first group (torch names it "0"): the
    rendezvous store under "default_pg", then the helper's "<name>/" and "<device>/". What a
    trainer that hosts its weight group the plain torch way broadcasts under."""
    device = "cuda" if backend == "nccl" else "cpu"
    return f"default_pg/0//{device}/"


def assign_ranks(
    rank_counts: Iterable[int], first: int = FIRST_WORKER_RANK
) -> tuple[list[int], int]:
    """The first rank of each worker that joins (a worker takes `count` consecutive ranks: an
    SGLang engine one per tensor-parallel GPU) from rank `first`, and the group's world
    size."""
    firsts, rank = [], first
    for count in rank_counts:
        if count < 1:
            raise ValueError(f"a worker joins with at least one rank, got {count}")
        firsts.append(rank)
        rank += count
    return firsts, rank


def process_group(
    backend: str, store: Any, prefix: str, rank: int, world: int, timeout: datetime.timedelta
) -> Any:
    """This rank's process group object (not torch.distributed's default group) under
    `prefix` in `store`: gloo, or NCCL (CUDA tensors; the device is the tensors')."""
    import torch.distributed as dist

    keys = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(keys, rank, world, opts)
    return dist.ProcessGroupGloo(keys, rank, world, timeout)


def received_tensors(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    specs: TensorSpecs,
    timeout: datetime.timedelta,
    backend: str = "gloo",
    device: str = "cpu",
) -> Iterator[tuple[str, Tensor]]:
    """Join the broadcast group kept in `store` under `prefix` as `rank` of `world` and yield
    each tensor of `specs` as rank 0 broadcasts it (the daemon's and a worker's side alike;
    one tensor in memory at a time unless the caller keeps them), on `device`: "cpu" for
    gloo, the worker's CUDA device for NCCL."""
    import torch
    import torch.distributed as dist

    group = process_group(backend, store, prefix, rank, world, timeout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, TensorSpec.TORCH_DTYPES[dtype]), device=device)
        group.broadcast([t], opts).wait()
        yield name, t
        del t  # before the next one is allocated: the caller's copy is the only one left
    if backend == "nccl":
        # NCCL's wait() orders the device stream, not the host: every broadcast must have
        # landed before the group (freed with this generator) tears its communicator down.
        torch.cuda.synchronize(device)
