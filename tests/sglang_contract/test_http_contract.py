"""The HTTP door's /generate against the real sglang (0.5.23): every body tltd accepts is a
valid GenerateReqInput with valid SamplingParams, the fields tltd takes exist in SGLang's
structs, and tltd's finish reasons are SGLang's own JSON. The cases come from http_cases.json,
which the main suite keeps true of tltd (tests/http_api/test_sglang_cases.py): this
environment has no gRPC, so tltd's HTTP modules are not imported here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import pytest
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct, schedule_batch
from sglang.srt.sampling import sampling_params
from sglang.srt.session.session_controller import Session

CASES = json.loads((Path(__file__).parent / "http_cases.json").read_text())
VOCAB = 64


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)  # msgspec structs


@pytest.mark.parametrize(
    "body", CASES["generate_bodies"] + list(CASES["framework_bodies"].values())
)
def test_accepted_bodies_are_valid_generate_req_inputs(body):
    obj = io_struct.GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    params = body["sampling_params"]
    for p in params if isinstance(params, list) else [params]:
        sampling_params.SamplingParams(**p).verify(VOCAB)


def test_the_fields_tltd_takes_exist_in_sglang():
    fields = CASES["fields"]
    assert set(fields["GenerateReqInput"]) <= _fields(io_struct.GenerateReqInput)
    assert set(fields["SamplingParams"]) <= _fields(sampling_params.SamplingParams)
    for struct in (
        "UpdateWeightFromDiskReqInput",
        "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "DestroyWeightsUpdateGroupReqInput",
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "AbortReq",
        "OpenSessionReqInput",
        "CloseSessionReqInput",
        "SessionParams",
    ):
        assert set(fields[struct]) <= _fields(getattr(io_struct, struct)), struct


def test_finish_reasons_are_sglangs_json():
    reasons = CASES["finish_reasons"]
    assert reasons["matched_token_2"] == schedule_batch.FINISH_MATCHED_TOKEN(2).to_json()
    assert reasons["length_3"] == schedule_batch.FINISH_LENGTH(3).to_json()


SESSIONS = CASES["sessions"]


@pytest.mark.parametrize(
    ("struct", "body"),
    [
        (io_struct.OpenSessionReqInput, SESSIONS["open_rids"]),
        (io_struct.OpenSessionReqInput, SESSIONS["open_streaming"]),
        *((io_struct.CloseSessionReqInput, b) for b in SESSIONS["close"]),
    ],
)
def test_session_route_bodies_are_sglangs(struct, body):
    # as SGLang's HTTP server reads them (FastAPI: pydantic over the msgspec struct)
    obj = TypeAdapter(struct).validate_python(body)
    assert {k: getattr(obj, k) for k in body} == body


@pytest.mark.parametrize("body", SESSIONS["turns_rids"] + SESSIONS["turns_streaming"])
def test_session_turns_are_valid_generate_req_inputs(body):
    obj = io_struct.GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    params = io_struct.SessionParams(**obj.session_params)  # as the tokenizer manager does
    assert msgspec.convert(msgspec.to_builtins(params), io_struct.SessionParams) == params
    assert {k: getattr(params, k) for k in body["session_params"]} == body["session_params"]
    sampling_params.SamplingParams(**body["sampling_params"]).verify(VOCAB)


class _Req:
    """What SGLang's Session reads of a request it made: tokens, output, whether finished."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)
        self.output_ids: list[int] = []
        self.finished_reason = None
        self.multimodal_inputs = self.full_untruncated_fill_ids = None
        self.aborted = ""

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, message: str) -> None:
        self.aborted = message

    def inherit_mm_token_counts(self, last) -> None:
        pass


class _Tokenized:
    """A TokenizedGenerateReqInput as Session.create_req reads it (other fields: None)."""

    def __init__(self, body: dict, rid: str) -> None:
        self.session_params = io_struct.SessionParams(**body["session_params"])
        self.input_ids, self.rid = list(body["input_ids"]), rid
        self.sampling_params = sampling_params.SamplingParams(**body["sampling_params"])

    def __getattr__(self, name):
        return None


@pytest.mark.parametrize(("opened", "turns"), [("open_rids", "turns_rids"),
                                                ("open_streaming", "turns_streaming")])  # fmt: skip
def test_sglang_builds_each_turns_context_as_tltd_does(opened, turns):
    """SGLang's own session controller, fed these bodies and made-up outputs, sees what a
    tltd session's turn sees: the prompt, then each turn's output and the next input."""
    body = SESSIONS[opened]
    sid = body["session_id"]
    session = Session(body["capacity_of_str_len"], sid, streaming=bool(body.get("streaming")))
    expected: list[int] = []
    for k, turn in enumerate(SESSIONS[turns]):
        # the daemon's turn ids, which the rid bodies name
        req = session.create_req(_Tokenized(turn, f"session:{sid}:{k}:0"), None, VOCAB,
                                 req_factory=_Req)  # fmt: skip
        assert not req.aborted, req.aborted
        expected += turn["input_ids"]
        assert list(req.origin_input_ids) == expected
        req.output_ids = [40 + 3 * k, 41 + 3 * k, 42 + 3 * k]
        req.finished_reason = "length"
        expected += req.output_ids
        if session.streaming:  # a streaming session records a turn once it is done
            req.full_untruncated_fill_ids = list(expected)  # a list: SGLang then copies
            session.finish_req(req)
