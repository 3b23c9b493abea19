"""The HTTP door's /generate against the real sglang (0.5.23): every body tltd accepts is a
valid GenerateReqInput with valid SamplingParams, the fields tltd takes exist in SGLang's
structs, and tltd's finish reasons are SGLang's own JSON. The cases come from http_cases.json,
which the main suite keeps true of tltd (tests/http_api/test_sglang_cases.py): this
environment has no gRPC, so tltd's HTTP modules are not imported here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sglang.srt.managers import io_struct, schedule_batch
from sglang.srt.sampling import sampling_params

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
    ):
        assert set(fields[struct]) <= _fields(getattr(io_struct, struct)), struct


def test_finish_reasons_are_sglangs_json():
    reasons = CASES["finish_reasons"]
    assert reasons["matched_token_2"] == schedule_batch.FINISH_MATCHED_TOKEN(2).to_json()
    assert reasons["length_3"] == schedule_batch.FINISH_LENGTH(3).to_json()
