"""Explicit conversions between ORM rows and domain dataclasses (the only place both meet)."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from tltd.domain import (
    Backend,
    Device,
    DeviceKind,
    DeviceProcess,
    DeviceState,
    DrafterStatus,
    DrafterVersion,
    Event,
    FinishReason,
    Job,
    JobStatus,
    LogprobMode,
    PolicySwitch,
    PolicyVersion,
    PromptLogprobs,
    RequestStatus,
    RolloutRequest,
    Sample,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeMode,
    SpeculativeStats,
    TokenProvenance,
    TokenSource,
    TopLogprobs,
    Worker,
    WorkerKind,
    WorkerState,
)
from tltd.store.tables import (
    DeviceRow,
    DrafterVersionRow,
    EventRow,
    JobRow,
    PolicyVersionRow,
    RolloutRequestRow,
    SampleRow,
    WorkerRow,
)


def job_to_row(job: Job, row: JobRow | None = None) -> JobRow:
    row = row or JobRow(job_id=job.job_id)
    spec = job.speculative
    row.name = job.name
    row.model_path = job.model_path
    row.backend = str(job.backend)
    row.priority = job.priority
    row.weight = job.weight
    row.spec_mode = str(spec.mode)
    row.spec_batch_threshold = spec.batch_threshold
    row.spec_draft_lengths = list(spec.draft_lengths)
    row.spec_drafter = spec.drafter
    row.spec_online_training = spec.online_training
    row.spec_initial_drafter_path = spec.initial_drafter_path
    row.policy_switch = str(job.policy_switch)
    row.status = str(job.status)
    row.status_reason = job.status_reason
    row.policy_version = job.policy_version
    return row


def job_from_row(row: JobRow, drafter_version: int = 0) -> Job:
    return Job(
        job_id=row.job_id,
        model_path=row.model_path,
        name=row.name,
        backend=Backend(row.backend),
        priority=row.priority,
        weight=row.weight,
        speculative=SpeculativeConfig(
            mode=SpeculativeMode(row.spec_mode),
            batch_threshold=row.spec_batch_threshold,
            draft_lengths=tuple(int(x) for x in row.spec_draft_lengths),
            drafter=row.spec_drafter,
            online_training=row.spec_online_training,
            initial_drafter_path=row.spec_initial_drafter_path,
        ),
        status=JobStatus(row.status),
        status_reason=row.status_reason,
        policy_version=row.policy_version,
        drafter_version=drafter_version,
        created_at=row.created_at,
        updated_at=row.updated_at,
        policy_switch=PolicySwitch(row.policy_switch),
    )


def policy_version_from_row(row: PolicyVersionRow) -> PolicyVersion:
    return PolicyVersion(
        job_id=row.job_id,
        version=row.version,
        source=row.source,
        path=row.path,
        note=row.note,
        created_at=row.created_at,
    )


def seed_to_column(seed: int) -> int:
    """A uint64 seed as the signed BIGINT column holds it: its two's complement (lossless; a
    seed >= 2**63 is stored negative)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def seed_from_column(value: int) -> int:
    """The uint64 seed back from its signed column value."""
    return value + (1 << 64) if value < 0 else value


def request_to_row(req: RolloutRequest) -> RolloutRequestRow:
    sp = req.sampling
    return RolloutRequestRow(
        request_id=req.request_id,
        job_id=req.job_id,
        prompts=[list(p) for p in req.prompts],
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_new_tokens=sp.max_new_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        seed=None if sp.seed is None else seed_to_column(sp.seed),
        logprob_mode=str(sp.logprob_mode),
        return_provenance=sp.return_provenance,
        top_logprobs=sp.top_logprobs,
        prompt_logprobs=sp.prompt_logprobs,
        speculative=str(req.speculative),
        policy_version=req.policy_version,
        status=str(req.status),
        status_reason=req.status_reason,
        samples_done=req.samples_done,
    )


def request_from_row(row: RolloutRequestRow) -> RolloutRequest:
    return RolloutRequest(
        request_id=row.request_id,
        job_id=row.job_id,
        prompts=tuple(tuple(int(t) for t in p) for p in row.prompts),
        sampling=SamplingParams(
            n=row.n,
            temperature=row.temperature,
            top_p=row.top_p,
            top_k=row.top_k,
            max_new_tokens=row.max_new_tokens,
            stop_token_ids=tuple(int(t) for t in row.stop_token_ids),
            seed=None if row.seed is None else seed_from_column(row.seed),
            logprob_mode=LogprobMode(row.logprob_mode),
            return_provenance=row.return_provenance,
            top_logprobs=row.top_logprobs,
            prompt_logprobs=row.prompt_logprobs,
        ),
        speculative=SpeculativeMode(row.speculative),
        policy_version=row.policy_version,
        status=RequestStatus(row.status),
        status_reason=row.status_reason,
        samples_done=row.samples_done,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def sample_to_row(s: Sample) -> SampleRow:
    spec = s.speculative
    return SampleRow(
        request_id=s.request_id,
        prompt_index=s.prompt_index,
        sample_index=s.sample_index,
        **_payload(s.token_ids, s.logprobs),
        num_tokens=len(s.token_ids),
        finish_reason=str(s.finish_reason),
        policy_version=s.policy_version,
        drafter_version=s.drafter_version,
        spec_draft_steps=spec.draft_steps,
        spec_plain_steps=spec.plain_steps,
        spec_accepted_tokens=spec.accepted_tokens,
        spec_mean_accepted_length=spec.mean_accepted_length,
        spec_drafted_tokens=spec.drafted_tokens,
        spec_bonus_tokens=spec.bonus_tokens,
        spec_residual_tokens=spec.residual_tokens,
        provenance=provenance_to_json(s.provenance),
        policy_spans=[list(x) for x in s.policy_spans] or None,
        top_logprobs=None if s.top_logprobs is None else [_top_to_json(t) for t in s.top_logprobs],
        prompt_logprobs=prompt_logprobs_to_json(s.prompt_logprobs),
        partial=s.partial,
        error=s.error,
    )


_LITTLE = sys.byteorder == "little"


def _packed(typecode: str, values: Sequence[float] | Sequence[int]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpacked(typecode: str, blob: bytes) -> tuple:
    a = array(typecode)
    a.frombytes(blob)
    if not _LITTLE:
        a.byteswap()
    return tuple(a)


def _payload(ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, object]:
    """A sample's token ids and logprobs as column values: packed, or JSON for ids that do
    not fit int32 (no tokenizer has such ids, but the store refuses nothing it took before)."""
    try:
        return {
            "token_ids_bin": _packed("i", ids),
            "logprobs_bin": _packed("d", logprobs),
            "token_ids": None,
            "logprobs": None,
        }
    except OverflowError:
        return {
            "token_ids_bin": None,
            "logprobs_bin": None,
            "token_ids": list(ids),
            "logprobs": [float(x) for x in logprobs],
        }


def token_ids_from_columns(blob: bytes | None, json: list | None) -> tuple[int, ...]:
    """A sample's token ids from its packed column, or from JSON (rows stored before)."""
    if blob is not None:
        return _unpacked("i", blob)
    return tuple(int(t) for t in json or ())


def logprobs_from_columns(blob: bytes | None, json: list | None) -> tuple[float, ...]:
    if blob is not None:
        return _unpacked("d", blob)
    return tuple(float(x) for x in json or ())


def sample_from_row(row: SampleRow) -> Sample:
    return Sample(
        request_id=row.request_id,
        prompt_index=row.prompt_index,
        sample_index=row.sample_index,
        token_ids=token_ids_from_columns(row.token_ids_bin, row.token_ids),
        logprobs=logprobs_from_columns(row.logprobs_bin, row.logprobs),
        finish_reason=FinishReason(row.finish_reason),
        policy_version=row.policy_version,
        drafter_version=row.drafter_version,
        speculative=SpeculativeStats(
            draft_steps=row.spec_draft_steps,
            plain_steps=row.spec_plain_steps,
            accepted_tokens=row.spec_accepted_tokens,
            mean_accepted_length=row.spec_mean_accepted_length,
            drafted_tokens=row.spec_drafted_tokens,
            bonus_tokens=row.spec_bonus_tokens,
            residual_tokens=row.spec_residual_tokens,
        ),
        partial=row.partial,
        error=row.error,
        provenance=provenance_from_json(row.provenance),
        policy_spans=tuple((int(i), int(v)) for i, v in row.policy_spans or ()),
        top_logprobs=None
        if row.top_logprobs is None
        else tuple(_top_from_json(t) for t in row.top_logprobs),
        prompt_logprobs=prompt_logprobs_from_json(row.prompt_logprobs),
    )


def _to_json_floats(xs: tuple[float, ...]) -> list[float | None]:
    """-inf (a token top-k / top-p excluded) as null: JSON has no infinity, PostgreSQL's
    JSON refuses one."""
    return [None if math.isinf(x) else x for x in xs]


def _from_json_floats(xs: list[float | None]) -> tuple[float, ...]:
    return tuple(float("-inf") if x is None else float(x) for x in xs)


def _top_to_json(t: TopLogprobs) -> list[list[Any]]:
    return [list(t.token_ids), _to_json_floats(t.logprobs)]


def _top_from_json(data: list[list[Any]]) -> TopLogprobs:
    ids, lps = data
    return TopLogprobs(tuple(int(i) for i in ids), _from_json_floats(lps))


def prompt_logprobs_to_json(p: PromptLogprobs | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "logprobs": _to_json_floats(p.logprobs),
        "ranks": list(p.ranks),
        "top": [_top_to_json(t) for t in p.top],
    }


def prompt_logprobs_from_json(data: dict[str, Any] | None) -> PromptLogprobs | None:
    if data is None:
        return None
    return PromptLogprobs(
        _from_json_floats(data["logprobs"]),
        tuple(int(r) for r in data["ranks"]),
        tuple(_top_from_json(t) for t in data["top"]),
    )


def provenance_to_json(prov: tuple[TokenProvenance, ...] | None) -> list[list[object]] | None:
    """One [source, drafter, draft_length] triple per token (None: not asked for)."""
    if prov is None:
        return None
    return [[str(p.source), p.drafter, p.draft_length] for p in prov]


def provenance_from_json(data: list[list[object]] | None) -> tuple[TokenProvenance, ...] | None:
    if data is None:
        return None
    return tuple(
        TokenProvenance(TokenSource(str(src)), str(drafter), int(n))  # type: ignore[call-overload]
        for src, drafter, n in data
    )


def drafter_to_row(dv: DrafterVersion, version: int) -> DrafterVersionRow:
    return DrafterVersionRow(
        job_id=dv.job_id,
        version=version,
        policy_version=dv.policy_version,
        path=dv.path,
        train_steps=dv.train_steps,
        loss=dv.loss,
        acceptance_length=dv.acceptance_length,
        status=str(dv.status),
        pinned=False,  # pinning goes through Store.pin_drafter only
        node_id=dv.node_id,
        shared=dv.shared,
    )


def drafter_from_row(row: DrafterVersionRow, active_version: int) -> DrafterVersion:
    return DrafterVersion(
        job_id=row.job_id,
        version=row.version,
        policy_version=row.policy_version,
        path=row.path,
        train_steps=row.train_steps,
        loss=row.loss,
        acceptance_length=row.acceptance_length,
        status=DrafterStatus(row.status),
        pinned=row.pinned,
        active=row.version == active_version,
        created_at=row.created_at,
        node_id=row.node_id,
        shared=row.shared,
    )


def processes_to_json(processes: tuple[DeviceProcess, ...]) -> list[dict[str, object]]:
    return [
        {"pid": p.pid, "used_memory_bytes": p.used_memory_bytes, "ours": p.ours} for p in processes
    ]


def processes_from_json(data: list[dict[str, object]] | None) -> tuple[DeviceProcess, ...]:
    return tuple(
        DeviceProcess(
            pid=int(p["pid"]),  # type: ignore[call-overload]
            used_memory_bytes=int(p.get("used_memory_bytes", 0)),  # type: ignore[call-overload]
            ours=bool(p.get("ours", False)),
        )
        for p in data or []
    )


def device_from_row(row: DeviceRow) -> Device:
    return Device(
        device_id=row.device_id,
        kind=DeviceKind(row.kind),
        index=row.device_index,
        uuid=row.uuid,
        name=row.name,
        memory_total_bytes=row.memory_total_bytes,
        memory_used_bytes=row.memory_used_bytes,
        utilization=row.utilization,
        processes=processes_from_json(row.processes),
        foreign=row.foreign,
        cordoned=row.cordoned,
        draining=row.draining,
        state=DeviceState(row.state),
        state_reason=row.state_reason,
        updated_at=row.updated_at,
    )


def worker_from_row(row: WorkerRow) -> Worker:
    return Worker(
        worker_id=row.worker_id,
        kind=WorkerKind(row.kind),
        device_id=row.device_id,
        job_id=row.job_id,
        state=WorkerState(row.state),
        pid=row.pid,
        state_reason=row.state_reason,
        started_at=row.started_at,
        last_heartbeat=row.last_heartbeat,
    )


def event_from_row(row: EventRow) -> Event:
    return Event(
        entity=row.entity,
        entity_id=row.entity_id,
        old_status=row.old_status,
        new_status=row.new_status,
        reason=row.reason,
        at=row.at,
        event_id=row.id,
    )
