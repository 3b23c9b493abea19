"""Conversions between ORM rows and domain dataclasses (the only place both meet).

A field stored in a column of its own name (after a prefix such as "spec_") is copied by
`_columns` / `_from_columns`, enums as their values; the fields stored otherwise are written out
where they are converted.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import typing
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, TypeVar

from tltd.domain import (
    AgentSession,
    Device,
    DeviceProcess,
    DrafterVersion,
    Event,
    FinishReason,
    Job,
    LogprobMode,
    PolicyVersion,
    PromptLogprobs,
    RolloutRequest,
    Sample,
    SamplingParams,
    SessionStatus,
    SessionSummary,
    SessionTurn,
    SpeculativeConfig,
    SpeculativeStats,
    TokenProvenance,
    TokenSource,
    TopLogprobs,
    TurnStatus,
    Worker,
    field_names,
)
from tltd.store.tables import (
    DeviceRow,
    DrafterVersionRow,
    EventRow,
    JobRow,
    PolicyVersionRow,
    RolloutRequestRow,
    SampleRow,
    SessionRow,
    SessionTurnRow,
    WorkerRow,
)

_T = TypeVar("_T")


def _columns(obj: Any, *, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A domain dataclass's fields as column values, under the fields' names after `prefix`
    (enums as their values), less `skip`."""
    return {
        prefix + name: str(v) if isinstance(v := getattr(obj, name), enum.Enum) else v
        for name in field_names(type(obj), skip)
    }


@functools.cache
def _enum_fields(cls: type) -> dict[str, type[enum.Enum]]:
    """The fields typed as an enum (a column holds its value)."""
    hints = typing.get_type_hints(cls)
    return {n: t for n, t in hints.items() if isinstance(t, type) and issubclass(t, enum.Enum)}


def _from_columns(cls: type[_T], row: Any, *, prefix: str = "", **given: Any) -> _T:
    """A domain dataclass from the row's columns named as its fields (after `prefix`), enums
    from their values; `given` holds the fields stored otherwise. A field with neither a
    column nor a given value fails here (AttributeError), not as a silent default."""
    enums = _enum_fields(cls)
    values = {}
    for name in field_names(cls, tuple(given)):
        value = getattr(row, prefix + name)
        values[name] = enums[name](value) if name in enums else value
    return cls(**values, **given)


def job_to_row(job: Job, row: JobRow | None = None) -> JobRow:
    row = row or JobRow(job_id=job.job_id)
    columns = {
        # Not stored with the job: its id is the row's key, the drafter version is read from
        # the drafter versions, the times are the store's, the bounded stats are counted.
        **_columns(
            job,
            skip=(
                "job_id",
                "speculative",
                "drafter_version",
                "created_at",
                "updated_at",
                "bounded",
            ),
        ),  # fmt: skip
        **_columns(job.speculative, prefix="spec_"),
        "spec_draft_lengths": list(job.speculative.draft_lengths),
    }
    for name, value in columns.items():
        if name not in JobRow.__table__.columns:  # setattr would not fail on a typo
            raise AttributeError(f"JobRow has no column {name!r}")
        setattr(row, name, value)
    return row


def job_from_row(row: JobRow, drafter_version: int = 0) -> Job:
    spec = _from_columns(
        SpeculativeConfig,
        row,
        prefix="spec_",
        draft_lengths=tuple(int(x) for x in row.spec_draft_lengths),
    )
    return _from_columns(Job, row, speculative=spec, drafter_version=drafter_version, bounded=None)


def policy_version_from_row(row: PolicyVersionRow) -> PolicyVersion:
    return _from_columns(PolicyVersion, row)


def seed_to_column(seed: int) -> int:
    """A uint64 seed as the signed BIGINT column holds it: its two's complement (lossless; a
    seed >= 2**63 is stored negative)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def seed_from_column(value: int) -> int:
    """The uint64 seed back from its signed column value."""
    return value + (1 << 64) if value < 0 else value


def request_to_row(req: RolloutRequest) -> RolloutRequestRow:
    return RolloutRequestRow(**request_columns(req))


def request_columns(req: RolloutRequest) -> dict[str, Any]:
    """A request's column values (a Core insert's row; the times not included)."""
    sp = req.sampling
    return {
        **_columns(req, skip=("prompts", "sampling", "created_at", "updated_at", "preferred_node")),
        **_columns(sp, skip=("stop_token_ids", "seed")),
        "prompts": [list(p) for p in req.prompts],
        "stop_token_ids": list(sp.stop_token_ids),
        "seed": None if sp.seed is None else seed_to_column(sp.seed),
    }


def request_from_row(row: RolloutRequestRow) -> RolloutRequest:
    sampling = _from_columns(
        SamplingParams,
        row,
        stop_token_ids=tuple(int(t) for t in row.stop_token_ids),
        seed=None if row.seed is None else seed_from_column(row.seed),
    )
    prompts = tuple(tuple(int(t) for t in p) for p in row.prompts)
    return _from_columns(RolloutRequest, row, prompts=prompts, sampling=sampling, preferred_node="")


def sample_to_row(s: Sample) -> SampleRow:
    return SampleRow(**sample_columns(s))


def sample_columns(s: Sample) -> dict[str, Any]:
    """A sample's column values (a Core insert's row; `id` and `created_at` not included)."""
    return {
        **_columns(s, skip=_SAMPLE_STORED_OTHERWISE),
        **_columns(s.speculative, prefix="spec_"),
        **_payload(s.token_ids, s.logprobs),
        "num_tokens": len(s.token_ids),
        "provenance": provenance_to_json(s.provenance),
        "policy_spans": [list(x) for x in s.policy_spans] or None,
        "top_logprobs": (
            None if s.top_logprobs is None else [_top_to_json(t) for t in s.top_logprobs]
        ),
        "prompt_logprobs": prompt_logprobs_to_json(s.prompt_logprobs),
    }


# A sample's fields that are not a column of their own name (packed, JSON, or prefixed).
_SAMPLE_STORED_OTHERWISE = (
    "token_ids",
    "logprobs",
    "speculative",
    "provenance",
    "policy_spans",
    "top_logprobs",
    "prompt_logprobs",
    "prompt_token_ids",  # not stored: the request holds its prompts
    "reused_tokens",  # not stored: the worker's count, for the sessions' pins
)


def _packed(code: str, values: Sequence[float] | Sequence[int]) -> bytes:
    """Little-endian, whatever this machine's order (struct: about twice as fast as array)."""
    return struct.pack(f"<{len(values)}{code}", *values)


_SIZE = {"i": 4, "d": 8}


def _unpacked(code: str, blob: bytes) -> tuple:
    return struct.unpack(f"<{len(blob) // _SIZE[code]}{code}", blob)


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
    except (OverflowError, struct.error):
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
    return _from_columns(
        Sample,
        row,
        token_ids=token_ids_from_columns(row.token_ids_bin, row.token_ids),
        logprobs=logprobs_from_columns(row.logprobs_bin, row.logprobs),
        speculative=_from_columns(SpeculativeStats, row, prefix="spec_"),
        provenance=provenance_from_json(row.provenance),
        policy_spans=tuple((int(i), int(v)) for i, v in row.policy_spans or ()),
        top_logprobs=None
        if row.top_logprobs is None
        else tuple(_top_from_json(t) for t in row.top_logprobs),
        prompt_logprobs=prompt_logprobs_from_json(row.prompt_logprobs),
        prompt_token_ids=(),
        reused_tokens=0,
    )


# A sample's columns a checkpoint row holds as its own; the others go in its `state` (JSON).
_CHECKPOINT_COLUMNS = ("request_id", "prompt_index", "sample_index", "num_tokens",
                       "token_ids_bin", "logprobs_bin")  # fmt: skip


def checkpoint_columns(s: Sample) -> dict[str, Any]:
    """A running sample's checkpoint row (`updated_at` not included): its tokens so far
    packed, its other columns as `samples` would hold them (prompt logprobs left out: the
    resumed run's prefill computes them again)."""
    cols = sample_columns(replace(s, prompt_logprobs=None))
    own = {k: cols.pop(k) for k in _CHECKPOINT_COLUMNS}
    return own | {"state": cols}


def sample_from_checkpoint(row: Any) -> Sample:
    """The unfinished sample a checkpoint row holds (ABORTED, partial: to go on from)."""
    cols = {**row.state, **{k: getattr(row, k) for k in _CHECKPOINT_COLUMNS}}
    return sample_from_row(SimpleNamespace(**cols))  # type: ignore[arg-type]


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
        # `active` is the job's choice (not stored with the version), the time the store's.
        **_columns(dv, skip=("version", "pinned", "active", "created_at")),
        version=version,
        pinned=False,  # pinning goes through store.drafters.pin only
    )


def drafter_from_row(row: DrafterVersionRow, active_version: int) -> DrafterVersion:
    return _from_columns(DrafterVersion, row, active=row.version == active_version)


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
    processes = processes_from_json(row.processes)
    return _from_columns(Device, row, index=row.device_index, processes=processes)


def worker_from_row(row: WorkerRow) -> Worker:
    return _from_columns(Worker, row)


def event_from_row(row: EventRow) -> Event:
    return _from_columns(Event, row, event_id=row.id)


# ---- sessions --------------------------------------------------------------------------------


def packed_ids(ids: Sequence[int]) -> bytes:
    """Token ids as a session stores them (little-endian int32: ids come off the wire as
    int32)."""
    return _packed("i", ids)


def unpacked_ids(blob: bytes) -> tuple[int, ...]:
    return _unpacked("i", blob)


def sampling_to_json(s: SamplingParams) -> dict[str, Any]:
    """A turn's sampling as stored (the seed as text: JSON numbers lose a uint64's bits in
    some readers)."""
    return {
        **_columns(s, skip=("stop_token_ids", "seed")),
        "stop_token_ids": list(s.stop_token_ids),
        "seed": None if s.seed is None else str(s.seed),
    }


def sampling_from_json(data: dict[str, Any]) -> SamplingParams:
    given = {
        "stop_token_ids": tuple(int(t) for t in data["stop_token_ids"]),
        "seed": None if data["seed"] is None else int(data["seed"]),
        "logprob_mode": LogprobMode(data["logprob_mode"]),
    }
    names = field_names(SamplingParams, tuple(given))
    return SamplingParams(**{k: data[k] for k in names}, **given)


def turn_from_row(row: SessionTurnRow) -> SessionTurn:
    return SessionTurn(
        session_id=row.session_id,
        turn_index=row.turn_index,
        input_token_ids=_unpacked("i", row.input_bin),
        sampling=sampling_from_json(row.sampling),
        request_id=row.request_id,
        status=TurnStatus(row.status),
        token_ids=_unpacked("i", row.token_ids_bin) if row.token_ids_bin is not None else (),
        logprobs=_unpacked("d", row.logprobs_bin) if row.logprobs_bin is not None else (),
        finish_reason=FinishReason(row.finish_reason) if row.finish_reason else None,
        policy_version=row.policy_version,
        policy_spans=tuple((int(i), int(v)) for i, v in row.policy_spans or ()),
    )


def fill_turn_row(row: SessionTurnRow, sample: Sample) -> None:
    """A done turn's columns from the sample its request produced."""
    row.status = TurnStatus.DONE.value
    row.token_ids_bin = _packed("i", sample.token_ids)
    row.logprobs_bin = _packed("d", sample.logprobs)
    row.finish_reason = sample.finish_reason.value
    row.policy_version = sample.policy_version
    row.policy_spans = [list(x) for x in sample.policy_spans] or None


def session_summary(row: SessionRow, running_turn: int) -> SessionSummary:
    return SessionSummary(
        session_id=row.session_id,
        job_id=row.job_id,
        status=SessionStatus(row.status),
        num_turns=row.num_turns,
        num_tokens=row.num_tokens,
        running_turn=running_turn,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def session_from_rows(row: SessionRow, turns: Sequence[SessionTurnRow]) -> AgentSession:
    return AgentSession(
        session_id=row.session_id,
        job_id=row.job_id,
        prompt_token_ids=_unpacked("i", row.prompt_bin),
        status=SessionStatus(row.status),
        num_turns=row.num_turns,
        num_tokens=row.num_tokens,
        attempts=row.attempts,
        turns=tuple(turn_from_row(t) for t in turns),
        streaming=row.streaming,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )
