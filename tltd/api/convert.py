"""The one proto <-> domain converter: enums, timestamps and request defaults live here only."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from tltd import domain as d
from tltd.errors import InvalidArgument
from tltd.v1 import (
    admin_pb2,
    common_pb2,
    drafter_pb2,
    job_pb2,
    policy_pb2,
    rollout_pb2,
)

# ---- enums: explicit tables (both directions) so a renamed member fails loudly -------------

_BACKEND = {common_pb2.BACKEND_TORCH: d.Backend.TORCH, common_pb2.BACKEND_SGLANG: d.Backend.SGLANG}
_SPEC_MODE = {
    common_pb2.SPECULATIVE_MODE_AUTO: d.SpeculativeMode.AUTO,
    common_pb2.SPECULATIVE_MODE_OFF: d.SpeculativeMode.OFF,
}
_JOB_STATUS = {
    job_pb2.JOB_STATUS_ACTIVE: d.JobStatus.ACTIVE,
    job_pb2.JOB_STATUS_CANCELLED: d.JobStatus.CANCELLED,
    job_pb2.JOB_STATUS_FAILED: d.JobStatus.FAILED,
}
_REQUEST_STATUS = {
    rollout_pb2.REQUEST_STATUS_QUEUED: d.RequestStatus.QUEUED,
    rollout_pb2.REQUEST_STATUS_RUNNING: d.RequestStatus.RUNNING,
    rollout_pb2.REQUEST_STATUS_COMPLETED: d.RequestStatus.COMPLETED,
    rollout_pb2.REQUEST_STATUS_CANCELLED: d.RequestStatus.CANCELLED,
    rollout_pb2.REQUEST_STATUS_FAILED: d.RequestStatus.FAILED,
}
_FINISH = {
    rollout_pb2.FINISH_REASON_STOP: d.FinishReason.STOP,
    rollout_pb2.FINISH_REASON_LENGTH: d.FinishReason.LENGTH,
    rollout_pb2.FINISH_REASON_CANCELLED: d.FinishReason.CANCELLED,
    rollout_pb2.FINISH_REASON_ABORTED: d.FinishReason.ABORTED,
    rollout_pb2.FINISH_REASON_FAILED: d.FinishReason.FAILED,
}
_LOGPROB_MODE = {
    rollout_pb2.LOGPROB_MODE_PROCESSED: d.LogprobMode.PROCESSED,
    rollout_pb2.LOGPROB_MODE_RAW: d.LogprobMode.RAW,
}
_TOKEN_SOURCE = {
    rollout_pb2.TOKEN_SOURCE_PLAIN: d.TokenSource.PLAIN,
    rollout_pb2.TOKEN_SOURCE_ACCEPTED: d.TokenSource.ACCEPTED,
    rollout_pb2.TOKEN_SOURCE_RESIDUAL: d.TokenSource.RESIDUAL,
    rollout_pb2.TOKEN_SOURCE_BONUS: d.TokenSource.BONUS,
}
# The drafter of a token's step; "" (a plain token) is UNSPECIFIED on the wire.
_DRAFTER_KIND = {
    rollout_pb2.DRAFTER_KIND_UNSPECIFIED: "",
    rollout_pb2.DRAFTER_KIND_NGRAM: "ngram",
    rollout_pb2.DRAFTER_KIND_EAGLE: "eagle",
    rollout_pb2.DRAFTER_KIND_HISTORY: "history",
}
_DRAFTER_STATUS = {
    drafter_pb2.DRAFTER_STATUS_CANDIDATE: d.DrafterStatus.CANDIDATE,
    drafter_pb2.DRAFTER_STATUS_PROMOTED: d.DrafterStatus.PROMOTED,
    drafter_pb2.DRAFTER_STATUS_REJECTED: d.DrafterStatus.REJECTED,
    drafter_pb2.DRAFTER_STATUS_RETIRED: d.DrafterStatus.RETIRED,
}


def _inverse(table: dict) -> dict:
    return {v: k for k, v in table.items()}


_BACKEND_PB = _inverse(_BACKEND)
_SPEC_MODE_PB = _inverse(_SPEC_MODE)
_JOB_STATUS_PB = _inverse(_JOB_STATUS)
_REQUEST_STATUS_PB = _inverse(_REQUEST_STATUS)
_FINISH_PB = _inverse(_FINISH)
_DRAFTER_STATUS_PB = _inverse(_DRAFTER_STATUS)
_LOGPROB_MODE_PB = _inverse(_LOGPROB_MODE)
_TOKEN_SOURCE_PB = _inverse(_TOKEN_SOURCE)
_DRAFTER_KIND_PB = _inverse(_DRAFTER_KIND)


def _known(table: dict, names, value: int, field: str):
    """The domain member for a proto enum value; None for UNSPECIFIED (0), which the proto
    documents as "default" / "inherit". Any other value (a newer client's member, or garbage)
    is refused by name: read as the default it would silently run something not asked for."""
    if value == 0:
        return None
    if value not in table:
        known = ", ".join(f"{names.Name(k)} ({k})" for k in table)
        raise InvalidArgument(f"unknown value {value}; known: {known}, or 0 (default)", field=field)
    return table[value]


_POLICY_SWITCH = {
    job_pb2.POLICY_SWITCH_FINISH_ON_START_VERSION: d.PolicySwitch.FINISH_ON_START_VERSION,
    job_pb2.POLICY_SWITCH_NEXT_STEP: d.PolicySwitch.NEXT_STEP,
}
_POLICY_SWITCH_PB = _inverse(_POLICY_SWITCH)


def policy_switch_from_pb(value: int, field: str = "policy_switch") -> d.PolicySwitch | None:
    """UNSPECIFIED -> None: FINISH_ON_START_VERSION."""
    return _known(_POLICY_SWITCH, job_pb2.PolicySwitch, value, field)


def backend_from_pb(value: int, field: str = "backend") -> d.Backend | None:
    """UNSPECIFIED -> None: the daemon's default."""
    return _known(_BACKEND, common_pb2.Backend, value, field)


def speculative_mode_from_pb(value: int, field: str) -> d.SpeculativeMode | None:
    """UNSPECIFIED -> None: inherit (request -> job -> AUTO)."""
    return _known(_SPEC_MODE, common_pb2.SpeculativeMode, value, field)


def speculative_mode_to_pb(mode: d.SpeculativeMode | None) -> int:
    """None -> UNSPECIFIED: inherit."""
    return common_pb2.SPECULATIVE_MODE_UNSPECIFIED if mode is None else _SPEC_MODE_PB[mode]


def job_statuses_from_pb(values) -> list[d.JobStatus]:
    """The statuses to list (empty = all). UNSPECIFIED or an unknown value is refused: dropping
    it would widen the filter, up to every job for [UNSPECIFIED]."""
    out = []
    for i, v in enumerate(values):
        if v not in _JOB_STATUS:
            what = "JOB_STATUS_UNSPECIFIED" if v == 0 else f"unknown value {v}"
            raise InvalidArgument(
                f"{what} is not a job status (an empty list means all)", field=f"statuses[{i}]"
            )
        out.append(_JOB_STATUS[v])
    return out


def job_status_to_pb(value: d.JobStatus) -> int:
    return _JOB_STATUS_PB[value]


def request_status_to_pb(value: d.RequestStatus) -> int:
    return _REQUEST_STATUS_PB[value]


def drafter_status_to_pb(value: d.DrafterStatus) -> int:
    return _DRAFTER_STATUS_PB[value]


# ---- timestamps ----------------------------------------------------------------------------


def ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """Domain datetimes are UTC; a naive one (SQLite drops tzinfo) is taken as UTC."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(value)
    return out


def from_ts(value: timestamp_pb2.Timestamp) -> datetime:
    return value.ToDatetime(tzinfo=UTC)


# ---- jobs ----------------------------------------------------------------------------------


def speculative_from_pb(pb: common_pb2.SpeculativeConfig) -> d.SpeculativeConfig:
    """Proto zero values mean "default"; batch_threshold stays 0 for the service to resolve."""
    defaults = d.SpeculativeConfig()
    return d.SpeculativeConfig(
        mode=speculative_mode_from_pb(pb.mode, "speculative.mode") or defaults.mode,
        batch_threshold=pb.batch_threshold,
        draft_lengths=tuple(pb.draft_lengths) or defaults.draft_lengths,
        drafter=pb.drafter or defaults.drafter,
        online_training=pb.online_training,
        initial_drafter_path=pb.initial_drafter_path,
    )


def speculative_to_pb(spec: d.SpeculativeConfig) -> common_pb2.SpeculativeConfig:
    return common_pb2.SpeculativeConfig(
        mode=speculative_mode_to_pb(spec.mode),
        batch_threshold=spec.batch_threshold,
        draft_lengths=list(spec.draft_lengths),
        drafter=spec.drafter,
        online_training=spec.online_training,
        initial_drafter_path=spec.initial_drafter_path,
    )


def new_job_from_pb(pb: job_pb2.CreateJobRequest) -> d.NewJob:
    return d.NewJob(
        job_id=pb.job_id,
        model_path=pb.model_path,
        name=pb.name,
        backend=backend_from_pb(pb.backend),
        priority=pb.priority,
        weight=pb.weight,
        speculative=speculative_from_pb(pb.speculative) if pb.HasField("speculative") else None,
        policy_switch=policy_switch_from_pb(pb.policy_switch),
    )


def job_to_pb(job: d.Job) -> job_pb2.Job:
    return job_pb2.Job(
        job_id=job.job_id,
        name=job.name,
        model_path=job.model_path,
        backend=_BACKEND_PB[job.backend],
        priority=job.priority,
        weight=job.weight,
        speculative=speculative_to_pb(job.speculative),
        status=job_status_to_pb(job.status),
        status_reason=job.status_reason,
        policy_version=job.policy_version,
        drafter_version=job.drafter_version,
        created_at=ts(job.created_at),
        updated_at=ts(job.updated_at),
        policy_switch=_POLICY_SWITCH_PB[job.policy_switch],
    )


# ---- rollouts ------------------------------------------------------------------------------


def sampling_from_pb(pb: rollout_pb2.SamplingParams) -> d.SamplingParams:
    """Apply the documented defaults: n 0 -> 1, top_p unset -> 1, top_k 0 / -1 -> disabled (0),
    logprob_mode UNSPECIFIED -> PROCESSED (an unknown mode is refused, naming the field).

    Everything else passes through unchanged so validation can name a bad value (top_k < -1,
    top_p = 0, NaN temperature, max_new_tokens = 0).
    """
    return d.SamplingParams(
        n=pb.n or 1,
        temperature=pb.temperature,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=0 if pb.top_k in (0, -1) else pb.top_k,
        max_new_tokens=pb.max_new_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        seed=pb.seed if pb.HasField("seed") else None,
        logprob_mode=_known(
            _LOGPROB_MODE, rollout_pb2.LogprobMode, pb.logprob_mode, "sampling.logprob_mode"
        )
        or d.LogprobMode.PROCESSED,
        return_provenance=pb.return_provenance,
        top_logprobs=pb.top_logprobs,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )


def sampling_to_pb(s: d.SamplingParams) -> rollout_pb2.SamplingParams:
    pb = rollout_pb2.SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
        logprob_mode=_LOGPROB_MODE_PB[s.logprob_mode],
        return_provenance=s.return_provenance,
        top_logprobs=s.top_logprobs,
    )
    if s.seed is not None:
        pb.seed = s.seed
    if s.prompt_logprobs is not None:
        pb.prompt_logprobs = s.prompt_logprobs
    return pb


def rollout_from_pb(
    pb: rollout_pb2.GenerateRequest,
) -> tuple[d.RolloutRequest, d.SpeculativeMode | None]:
    """The request plus its speculative override (None = inherit the job's mode)."""
    req = d.RolloutRequest(
        request_id=pb.request_id,
        job_id=pb.job_id,
        prompts=tuple(tuple(p.token_ids) for p in pb.prompts),
        sampling=sampling_from_pb(pb.sampling),
    )
    return req, speculative_mode_from_pb(pb.speculative, "speculative")


def rollout_to_pb(r: d.RolloutRequest) -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(
        request_id=r.request_id,
        job_id=r.job_id,
        status=request_status_to_pb(r.status),
        num_prompts=len(r.prompts),
        sampling=sampling_to_pb(r.sampling),
        samples_total=r.samples_total,
        samples_done=r.samples_done,
        status_reason=r.status_reason,
        created_at=ts(r.created_at),
        updated_at=ts(r.updated_at),
    )


def speculative_stats_to_pb(st: d.SpeculativeStats) -> rollout_pb2.SpeculativeStats:
    return rollout_pb2.SpeculativeStats(
        draft_steps=st.draft_steps,
        plain_steps=st.plain_steps,
        accepted_tokens=st.accepted_tokens,
        mean_accepted_length=st.mean_accepted_length,
        drafted_tokens=st.drafted_tokens,
        bonus_tokens=st.bonus_tokens,
        residual_tokens=st.residual_tokens,
    )


def speculative_stats_from_pb(pb: rollout_pb2.SpeculativeStats) -> d.SpeculativeStats:
    return d.SpeculativeStats(
        draft_steps=pb.draft_steps,
        plain_steps=pb.plain_steps,
        accepted_tokens=pb.accepted_tokens,
        mean_accepted_length=pb.mean_accepted_length,
        drafted_tokens=pb.drafted_tokens,
        bonus_tokens=pb.bonus_tokens,
        residual_tokens=pb.residual_tokens,
    )


def provenance_to_pb(prov: tuple[d.TokenProvenance, ...]) -> rollout_pb2.TokenProvenance:
    return rollout_pb2.TokenProvenance(
        source=[_TOKEN_SOURCE_PB[p.source] for p in prov],
        drafter=[_DRAFTER_KIND_PB[p.drafter] for p in prov],
        draft_length=[p.draft_length for p in prov],
    )


def provenance_from_pb(pb: rollout_pb2.TokenProvenance) -> tuple[d.TokenProvenance, ...]:
    """Parallel arrays -> one record per token. Arrays of different lengths or an unknown
    source or drafter are refused by name: read as a default they would misstate the token."""
    if not len(pb.source) == len(pb.drafter) == len(pb.draft_length):
        raise InvalidArgument(
            f"source, drafter and draft_length have {len(pb.source)}, {len(pb.drafter)} and "
            f"{len(pb.draft_length)} entries",
            field="provenance",
        )
    out = []
    for i, (src, kind, n) in enumerate(zip(pb.source, pb.drafter, pb.draft_length, strict=True)):
        if src not in _TOKEN_SOURCE:
            raise InvalidArgument(f"unknown token source {src}", field=f"provenance.source[{i}]")
        if kind not in _DRAFTER_KIND:
            raise InvalidArgument(f"unknown drafter kind {kind}", field=f"provenance.drafter[{i}]")
        out.append(d.TokenProvenance(_TOKEN_SOURCE[src], _DRAFTER_KIND[kind], n))
    return tuple(out)


def sample_to_pb(s: d.Sample) -> rollout_pb2.Sample:
    pb = rollout_pb2.Sample(
        request_id=s.request_id,
        prompt_index=s.prompt_index,
        sample_index=s.sample_index,
        token_ids=list(s.token_ids),
        logprobs=list(s.logprobs),
        finish_reason=_FINISH_PB[s.finish_reason],
        policy_version=s.policy_version,
        drafter_version=s.drafter_version,
        speculative=speculative_stats_to_pb(s.speculative),
        partial=s.partial,
        error=s.error,
    )
    if s.provenance is not None:
        pb.provenance.CopyFrom(provenance_to_pb(s.provenance))
    for first, version in s.policy_spans:
        pb.policy_spans.add(first_token=first, policy_version=version)
    for t in s.top_logprobs or ():
        pb.top_logprobs.add(token_ids=t.token_ids, logprobs=t.logprobs)
    if s.prompt_logprobs is not None:
        p = s.prompt_logprobs
        pb.prompt_logprobs.SetInParent()  # set even for a one-token prompt (no positions)
        pb.prompt_logprobs.logprobs.extend(p.logprobs)
        pb.prompt_logprobs.ranks.extend(p.ranks)
        for t in p.top:
            pb.prompt_logprobs.top.add(token_ids=t.token_ids, logprobs=t.logprobs)
    return pb


def _tops_from_pb(tops) -> tuple[d.TopLogprobs, ...]:
    return tuple(d.TopLogprobs(tuple(t.token_ids), tuple(t.logprobs)) for t in tops)


def sample_from_pb(pb: rollout_pb2.Sample) -> d.Sample:
    return d.Sample(
        request_id=pb.request_id,
        prompt_index=pb.prompt_index,
        sample_index=pb.sample_index,
        token_ids=tuple(pb.token_ids),
        logprobs=tuple(pb.logprobs),
        finish_reason=_FINISH.get(pb.finish_reason, d.FinishReason.FAILED),
        policy_version=pb.policy_version,
        drafter_version=pb.drafter_version,
        speculative=speculative_stats_from_pb(pb.speculative),
        partial=pb.partial,
        error=pb.error,
        provenance=provenance_from_pb(pb.provenance) if pb.HasField("provenance") else None,
        policy_spans=tuple((x.first_token, x.policy_version) for x in pb.policy_spans),
        # A sample that asked for alternatives but emitted no token has none on the wire.
        top_logprobs=_tops_from_pb(pb.top_logprobs) if pb.top_logprobs else None,
        prompt_logprobs=d.PromptLogprobs(
            tuple(pb.prompt_logprobs.logprobs),
            tuple(pb.prompt_logprobs.ranks),
            _tops_from_pb(pb.prompt_logprobs.top),
        )
        if pb.HasField("prompt_logprobs")
        else None,
    )


# ---- policy / drafters ---------------------------------------------------------------------


def policy_source_from_pb(pb: policy_pb2.UpdatePolicyRequest) -> tuple[str | None, str]:
    """Which oneof arm is set ("checkpoint" | "tensors" | "nccl" | None) and the checkpoint path."""
    source = pb.WhichOneof("source")
    return source, (pb.checkpoint.path if source == "checkpoint" else "")


def policy_to_pb(p: d.PolicyVersion) -> policy_pb2.PolicyVersion:
    return policy_pb2.PolicyVersion(
        job_id=p.job_id,
        version=p.version,
        source=p.source,
        path=p.path,
        created_at=ts(p.created_at),
        note=p.note,
    )


def push_part_from_pb(pb: policy_pb2.PushPolicyRequest) -> d.PushHeader | d.TensorChunk | bool:
    """One message of a push stream: its header, a chunk, or True for the commit."""
    part = pb.WhichOneof("part")
    if part == "header":
        return push_header_from_pb(pb.header)
    if part == "chunk":
        c = pb.chunk
        return d.TensorChunk(c.name, c.offset, c.length, c.data, c.delta, c.crc32c)
    if part == "commit":
        if not pb.commit:
            raise InvalidArgument("must be true when set", field="commit")
        return True
    raise InvalidArgument("one of header, chunk or commit is required", field="part")


def push_header_from_pb(h: policy_pb2.PushHeader) -> d.PushHeader:
    specs = tuple(d.TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in h.tensors)
    base = h.base_version if h.HasField("base_version") else None
    return d.PushHeader(h.job_id, h.update_id, specs, h.note, base)


def broadcast_group_to_pb(b: d.OpenedBroadcast) -> policy_pb2.BroadcastGroup:
    workers = None
    if b.workers is not None:
        w = b.workers
        workers = policy_pb2.WorkerGroup(
            prefix=w.prefix, world_size=w.world_size, backend=w.backend
        )
    return policy_pb2.BroadcastGroup(
        address=b.address,
        port=b.port,
        world_size=b.world_size,
        rank=0,
        prefix=b.prefix,
        backend="gloo",
        workers=workers,
    )


def push_status_to_pb(s: d.PushStatus) -> policy_pb2.PushStatus:
    return policy_pb2.PushStatus(
        job_id=s.job_id,
        update_id=s.update_id,
        tensors=[policy_pb2.TensorProgress(name=n, received=r, total=t) for n, r, t in s.received],
        bytes_received=s.bytes_received,
        bytes_total=s.bytes_total,
        version=s.version,
    )


def drafter_to_pb(v: d.DrafterVersion) -> drafter_pb2.DrafterVersion:
    return drafter_pb2.DrafterVersion(
        job_id=v.job_id,
        version=v.version,
        policy_version=v.policy_version,
        path=v.path,
        train_steps=v.train_steps,
        loss=_finite(v.loss),
        acceptance_length=_finite(v.acceptance_length),
        status=drafter_status_to_pb(v.status),
        pinned=v.pinned,
        active=v.active,
        created_at=ts(v.created_at),
        node_id=v.node_id,
        shared=v.shared,
    )


def _finite(x: float) -> float:
    # NaN would survive the wire but breaks JSON output in tltctl; 0 reads as "not measured".
    return x if math.isfinite(x) else 0.0


# ---- admin ---------------------------------------------------------------------------------


def device_to_pb(dev: d.Device) -> admin_pb2.Device:
    return admin_pb2.Device(
        device_id=dev.device_id,
        kind=dev.kind.value,
        index=dev.index,
        uuid=dev.uuid,
        name=dev.name,
        memory_total_bytes=dev.memory_total_bytes,
        memory_used_bytes=dev.memory_used_bytes,
        utilization=dev.utilization,
        processes=[
            admin_pb2.DeviceProcess(pid=p.pid, used_memory_bytes=p.used_memory_bytes, ours=p.ours)
            for p in dev.processes
        ],
        foreign=dev.foreign,
        cordoned=dev.cordoned,
        draining=dev.draining,
        state=dev.state.value,
        state_reason=dev.state_reason,
        updated_at=ts(dev.updated_at),
    )


def worker_to_pb(w: d.Worker) -> admin_pb2.Worker:
    return admin_pb2.Worker(
        worker_id=w.worker_id,
        kind=w.kind.value,
        device_id=w.device_id,
        job_id=w.job_id,
        state=w.state.value,
        pid=w.pid,
        started_at=ts(w.started_at),
        last_heartbeat=ts(w.last_heartbeat),
        state_reason=w.state_reason,
    )


def node_to_pb(n: d.Node) -> admin_pb2.Node:
    return admin_pb2.Node(
        node_id=n.node_id,
        address=n.address,
        state=n.status.value,
        epoch=n.epoch,
        heartbeat_age_seconds=n.heartbeat_age_seconds,
        started_at=ts(n.started_at),
        cordoned=n.cordoned,
        draining=n.draining,
    )


def stats_to_pb(s: d.Stats) -> admin_pb2.Stats:
    return admin_pb2.Stats(
        version=s.version,
        uptime_seconds=s.uptime_seconds,
        database=s.database,
        devices=s.devices,
        devices_schedulable=s.devices_schedulable,
        workers=s.workers,
        jobs_active=s.jobs_active,
        requests_by_status={str(k): int(v) for k, v in s.requests_by_status.items()},
        samples_total=s.samples_total,
        tokens_generated=s.tokens_generated,
        mean_accepted_length=_finite(s.mean_accepted_length),
        draining=s.draining,
    )
