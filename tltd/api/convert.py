"""The one proto <-> domain converter: enums, timestamps and request defaults live here only.

A domain field that a message holds under the same name and type is copied by `_same_named` /
`_from_same_named` (times as Timestamps); the fields that differ (enums, defaults, nested
messages, fields not on the wire) are written out where they are converted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

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
    session_pb2,
)

# ---- enums: explicit tables (both directions) so a renamed member fails loudly -------------

_BACKEND = {
    common_pb2.BACKEND_TORCH: d.Backend.TORCH,
    common_pb2.BACKEND_SGLANG: d.Backend.SGLANG,
    common_pb2.BACKEND_SIM: d.Backend.SIM,
}
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


# ---- fields of the same name ---------------------------------------------------------------

_T = TypeVar("_T")


def _same_named(obj: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A domain dataclass's fields as message fields of the same names (datetimes as
    Timestamps), less `skip`; a name the message lacks fails in its constructor."""
    return {
        name: ts(v) if isinstance(v := getattr(obj, name), datetime) else v
        for name in d.field_names(type(obj), skip)
    }


def _from_same_named(cls: type[_T], pb: Any, **given: Any) -> _T:
    """A domain dataclass from the message's fields of the same names; `given` holds the
    fields that differ (a field with neither fails here, not as a silent default)."""
    names = d.field_names(cls, tuple(given))
    return cls(**{n: getattr(pb, n) for n in names}, **given)


# ---- jobs ----------------------------------------------------------------------------------


def speculative_from_pb(pb: common_pb2.SpeculativeConfig) -> d.SpeculativeConfig:
    """Proto zero values mean "default"; batch_threshold stays 0 for the service to resolve."""
    defaults = d.SpeculativeConfig()
    return _from_same_named(
        d.SpeculativeConfig,
        pb,
        mode=speculative_mode_from_pb(pb.mode, "speculative.mode") or defaults.mode,
        draft_lengths=tuple(pb.draft_lengths) or defaults.draft_lengths,
        drafter=pb.drafter or defaults.drafter,
    )


def speculative_to_pb(spec: d.SpeculativeConfig) -> common_pb2.SpeculativeConfig:
    return common_pb2.SpeculativeConfig(
        **_same_named(spec, skip=("mode",)), mode=speculative_mode_to_pb(spec.mode)
    )


def new_job_from_pb(pb: job_pb2.CreateJobRequest) -> d.NewJob:
    return _from_same_named(
        d.NewJob,
        pb,
        backend=backend_from_pb(pb.backend),
        speculative=speculative_from_pb(pb.speculative) if pb.HasField("speculative") else None,
        policy_switch=policy_switch_from_pb(pb.policy_switch),
        max_staleness=pb.max_staleness if pb.HasField("max_staleness") else None,
    )


def job_to_pb(job: d.Job) -> job_pb2.Job:
    return job_pb2.Job(
        **_same_named(job, skip=("backend", "speculative", "status", "policy_switch", "bounded")),
        bounded=None if job.bounded is None else job_pb2.BoundedStats(**_same_named(job.bounded)),
        backend=_BACKEND_PB[job.backend],
        speculative=speculative_to_pb(job.speculative),
        status=job_status_to_pb(job.status),
        policy_switch=_POLICY_SWITCH_PB[job.policy_switch],
    )


# ---- rollouts ------------------------------------------------------------------------------


def sampling_from_pb(pb: rollout_pb2.SamplingParams) -> d.SamplingParams:
    """Apply the documented defaults: n 0 -> 1, top_p unset -> 1, top_k 0 / -1 -> disabled (0),
    logprob_mode UNSPECIFIED -> PROCESSED (an unknown mode is refused, naming the field).

    Everything else passes through unchanged so validation can name a bad value (top_k < -1,
    top_p = 0, NaN temperature, max_new_tokens = 0).
    """
    mode = _known(_LOGPROB_MODE, rollout_pb2.LogprobMode, pb.logprob_mode, "sampling.logprob_mode")
    return _from_same_named(
        d.SamplingParams,
        pb,
        n=pb.n or 1,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=0 if pb.top_k in (0, -1) else pb.top_k,
        stop_token_ids=tuple(pb.stop_token_ids),
        seed=pb.seed if pb.HasField("seed") else None,
        logprob_mode=mode or d.LogprobMode.PROCESSED,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )


def sampling_to_pb(s: d.SamplingParams) -> rollout_pb2.SamplingParams:
    pb = rollout_pb2.SamplingParams(
        **_same_named(s, skip=("logprob_mode", "seed", "prompt_logprobs")),
        logprob_mode=_LOGPROB_MODE_PB[s.logprob_mode],
    )
    # Optional on the wire: unset means none.
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
        bound_groups=pb.bound.groups,
        carried=pb.bound.carried,
        bound_park=pb.bound.park,
        bound_deadline_ms=pb.bound.deadline_ms,
        bound_tokens=pb.bound.max_tokens,
    )
    return req, speculative_mode_from_pb(pb.speculative, "speculative")


def rollout_to_pb(r: d.RolloutRequest) -> rollout_pb2.RolloutRequest:
    # The prompts go back as their count; the mode and policy version are not on the wire.
    not_sent = (
        "prompts", "speculative", "policy_version", "bound_groups", "carried", "bound_park",
        "bound_deadline_ms", "bound_tokens", "preferred_node",
    )  # fmt: skip
    return rollout_pb2.RolloutRequest(
        **_same_named(r, skip=("sampling", "status", *not_sent)),
        status=request_status_to_pb(r.status),
        num_prompts=len(r.prompts),
        sampling=sampling_to_pb(r.sampling),
        samples_total=r.samples_total,
    )


def speculative_stats_from_pb(pb: rollout_pb2.SpeculativeStats) -> d.SpeculativeStats:
    return _from_same_named(d.SpeculativeStats, pb)


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


# A sample's fields that are nested messages on the wire, filled part by part.
_SAMPLE_PARTS = ("provenance", "policy_spans", "top_logprobs", "prompt_logprobs")


def sample_to_pb(s: d.Sample) -> rollout_pb2.Sample:
    pb = rollout_pb2.Sample(**_sample_fields(s))
    _fill_sample_parts(pb, s)
    return pb


def generate_response(s: d.Sample) -> rollout_pb2.GenerateResponse:
    """A stream's message for one sample, built in place (wrapping a built Sample copies
    it: ~50 us for 4,096 tokens)."""
    resp = rollout_pb2.GenerateResponse(sample=_sample_fields(s))
    _fill_sample_parts(resp.sample, s)
    return resp


# A batched message's size bound: a re-attach reads every stored sample of a request at once,
# which can be far past the 64 MiB a message may have (thousands of long samples, top
# logprobs); a sample larger than this goes alone, as it would unbatched.
BATCH_MESSAGE_BYTES = 4 * 1024 * 1024


def generate_batch_responses(
    samples: list[d.Sample], max_bytes: int = BATCH_MESSAGE_BYTES
) -> Iterator[rollout_pb2.GenerateResponse]:
    """A stream's messages for samples ready together (`GenerateRequest.batch_samples`): as
    few as keep each under `max_bytes`, the samples in order."""
    resp, size = rollout_pb2.GenerateResponse(), 0
    for s in samples:
        pb = resp.samples.add(**_sample_fields(s))
        _fill_sample_parts(pb, s)
        grown = pb.ByteSize() + 8  # + the field's tag and length
        if size and size + grown > max_bytes:  # it starts the next message
            spill = rollout_pb2.GenerateResponse()
            spill.samples.append(pb)  # a copy
            del resp.samples[-1]
            yield resp
            resp, size = spill, 0
        size += grown
    if size:
        yield resp


def _sample_fields(s: d.Sample) -> dict[str, Any]:
    return {
        **_same_named(s, skip=("finish_reason", "speculative", "reused_tokens", *_SAMPLE_PARTS)),
        "finish_reason": _FINISH_PB[s.finish_reason],
        "speculative": _same_named(s.speculative),
    }


def _fill_sample_parts(pb: rollout_pb2.Sample, s: d.Sample) -> None:
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


def _tops_from_pb(tops) -> tuple[d.TopLogprobs, ...]:
    return tuple(d.TopLogprobs(tuple(t.token_ids), tuple(t.logprobs)) for t in tops)


def sample_from_pb(pb: rollout_pb2.Sample) -> d.Sample:
    return _from_same_named(
        d.Sample,
        pb,
        token_ids=tuple(pb.token_ids),
        logprobs=tuple(pb.logprobs),
        finish_reason=_FINISH.get(pb.finish_reason, d.FinishReason.FAILED),
        speculative=speculative_stats_from_pb(pb.speculative),
        provenance=provenance_from_pb(pb.provenance) if pb.HasField("provenance") else None,
        policy_spans=tuple((x.first_token, x.policy_version) for x in pb.policy_spans),
        prompt_token_ids=tuple(pb.prompt_token_ids),
        reused_tokens=0,
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
    return policy_pb2.PolicyVersion(**_same_named(p))


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
    workers = None if b.workers is None else policy_pb2.WorkerGroup(**_same_named(b.workers))
    return policy_pb2.BroadcastGroup(
        **_same_named(b, skip=("workers",)), rank=0, backend="gloo", workers=workers
    )


def push_status_to_pb(s: d.PushStatus) -> policy_pb2.PushStatus:
    return policy_pb2.PushStatus(
        **_same_named(s, skip=("received",)),
        tensors=[policy_pb2.TensorProgress(name=n, received=r, total=t) for n, r, t in s.received],
        bytes_received=s.bytes_received,
        bytes_total=s.bytes_total,
    )


def drafter_to_pb(v: d.DrafterVersion) -> drafter_pb2.DrafterVersion:
    return drafter_pb2.DrafterVersion(
        **_same_named(v, skip=("loss", "acceptance_length", "status")),
        loss=_finite(v.loss),
        acceptance_length=_finite(v.acceptance_length),
        status=drafter_status_to_pb(v.status),
    )


def _finite(x: float) -> float:
    # NaN would survive the wire but breaks JSON output in tltctl; 0 reads as "not measured".
    return x if math.isfinite(x) else 0.0


# ---- admin ---------------------------------------------------------------------------------


def device_to_pb(dev: d.Device) -> admin_pb2.Device:
    processes = [admin_pb2.DeviceProcess(**_same_named(p)) for p in dev.processes]
    return admin_pb2.Device(
        **_same_named(dev, skip=("kind", "state", "processes")),
        kind=dev.kind.value,
        state=dev.state.value,
        processes=processes,
    )


def worker_to_pb(w: d.Worker) -> admin_pb2.Worker:
    return admin_pb2.Worker(
        **_same_named(w, skip=("kind", "state")), kind=w.kind.value, state=w.state.value
    )


def node_to_pb(n: d.Node) -> admin_pb2.Node:
    # The heartbeat goes out as its age (by the database's clock), not as a time.
    return admin_pb2.Node(**_same_named(n, skip=("status", "heartbeat_at")), state=n.status.value)


def stats_to_pb(s: d.Stats) -> admin_pb2.Stats:
    return admin_pb2.Stats(
        **_same_named(s, skip=("requests_by_status", "mean_accepted_length")),
        requests_by_status={str(k): int(v) for k, v in s.requests_by_status.items()},
        mean_accepted_length=_finite(s.mean_accepted_length),
    )


# ---- sessions ------------------------------------------------------------------------------

_SESSION_STATUS_PB = {
    d.SessionStatus.OPEN: session_pb2.SESSION_STATUS_OPEN,
    d.SessionStatus.CLOSED: session_pb2.SESSION_STATUS_CLOSED,
}
_SESSION_STATUS = _inverse(_SESSION_STATUS_PB)
_TURN_STATUS_PB = {
    d.TurnStatus.RUNNING: session_pb2.TURN_STATUS_RUNNING,
    d.TurnStatus.DONE: session_pb2.TURN_STATUS_DONE,
}


def turn_to_pb(t: d.SessionTurn) -> session_pb2.Turn:
    pb = session_pb2.Turn(
        turn_index=t.turn_index,
        status=_TURN_STATUS_PB[t.status],
        input_token_ids=t.input_token_ids,
        token_ids=t.token_ids,
        logprobs=t.logprobs,
        finish_reason=_FINISH_PB[t.finish_reason] if t.finish_reason is not None else 0,
        policy_version=t.policy_version,
        request_id=t.request_id,
    )
    for first, version in t.policy_spans:
        pb.policy_spans.add(first_token=first, policy_version=version)
    return pb


def trajectory_to_pb(t: d.Trajectory) -> session_pb2.Trajectory:
    return session_pb2.Trajectory(**_same_named(t))


def session_to_pb(s: d.AgentSession) -> session_pb2.Session:
    return session_pb2.Session(
        **_same_named(s, skip=("prompt_token_ids", "status", "attempts", "turns")),
        status=_SESSION_STATUS_PB[s.status],
        turns=[turn_to_pb(t) for t in s.turns],
        trajectory=trajectory_to_pb(s.trajectory()),
    )


def session_group_to_pb(group_id: str, sessions: list[d.AgentSession]) -> session_pb2.SessionGroup:
    return session_pb2.SessionGroup(
        group_id=group_id, sessions=[session_to_pb(s) for s in sessions]
    )


def session_statuses_from_pb(values) -> list[d.SessionStatus]:
    """The statuses to list (empty = all); UNSPECIFIED or unknown is refused, as for jobs."""
    out = []
    for i, v in enumerate(values):
        if v not in _SESSION_STATUS:
            what = "SESSION_STATUS_UNSPECIFIED" if v == 0 else f"unknown value {v}"
            raise InvalidArgument(
                f"{what} is not a session status (an empty list means all)",
                field=f"statuses[{i}]",
            )
        out.append(_SESSION_STATUS[v])
    return out


def session_summary_to_pb(s: d.SessionSummary) -> session_pb2.SessionSummary:
    return session_pb2.SessionSummary(
        **_same_named(s, skip=("status",)), status=_SESSION_STATUS_PB[s.status]
    )
