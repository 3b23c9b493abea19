"""Contract with the real sglang package (the SGLang contract environment; skipped where sglang
does not import): every /generate body tltd accepts is a valid GenerateReqInput, the fields it
takes exist in SGLang's structs, and its finish reasons are SGLang's own JSON."""

from __future__ import annotations

import pytest

io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
schedule_batch = pytest.importorskip("sglang.srt.managers.schedule_batch")
sampling_params = pytest.importorskip("sglang.srt.sampling.sampling_params")

from tltd.domain import FinishReason, RolloutRequest, Sample, SamplingParams  # noqa: E402
from tltd.http import door, sglang_api  # noqa: E402
from tltd.http.vocab import Vocab  # noqa: E402

VOCAB = 64
# Bodies the HTTP tests send (and a slime-style caller sends): tltd accepts every one.
BODIES = [
    {
        "input_ids": [1, 5, 6],
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "sampling_seed": 5,
        },
    },
    {
        "input_ids": [[1, 5, 6], [1, 7]],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True},
    },
    {
        "input_ids": [[1, 5, 6], [1, 7]],
        "stream": True,
        "rid": "r-1",
        "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 5}],
    },
    {
        "input_ids": [1, 2],
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": True,
        "log_metrics": False,
        "sampling_params": {
            "min_new_tokens": 0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_p": 0.0,
        },
    },
]


def _fields(cls) -> set[str]:
    import dataclasses

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)  # msgspec structs


def _accepted(body) -> RolloutRequest:
    import json

    parsed = door.parse(sglang_api.GenerateRequest, json.dumps(body).encode())
    from tltd.domain import Job

    req, _params, _single = sglang_api.to_rollout(parsed, Job("j", "/m"), Vocab(None, ()), "")
    return req


@pytest.mark.parametrize("body", BODIES)
def test_accepted_bodies_are_valid_generate_req_inputs(body):
    _accepted(body)
    obj = io_struct.GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    params = body["sampling_params"]
    for p in params if isinstance(params, list) else [params]:
        sp = sampling_params.SamplingParams(**p)
        sp.verify(VOCAB)


def test_the_fields_tltd_takes_exist_in_sglang():
    assert set(sglang_api.GenerateRequest.model_fields) <= _fields(io_struct.GenerateReqInput)
    assert set(sglang_api.SglangSampling.model_fields) <= _fields(sampling_params.SamplingParams)
    assert set(sglang_api.UpdateWeightsRequest.model_fields) <= _fields(
        io_struct.UpdateWeightFromDiskReqInput
    )


def test_outputs_carry_what_sglang_returns_and_slime_reads():
    req = RolloutRequest("r", "j", ((1, 2),), SamplingParams(n=1, stop_token_ids=(2,)))
    body = door.parse(sglang_api.GenerateRequest, b'{"input_ids": [1, 2], "return_logprob": true}')
    params = sglang_api.SglangSampling()
    vocab = Vocab(None, ())

    def out(reason, ids):
        s = Sample("r", 0, 0, ids, tuple(-0.5 for _ in ids), reason, policy_version=3)
        return sglang_api.output(body, params, req, s, vocab)

    stop, length = out(FinishReason.STOP, (7, 2)), out(FinishReason.LENGTH, (7, 8, 9))
    assert stop["meta_info"]["finish_reason"] == schedule_batch.FINISH_MATCHED_TOKEN(2).to_json()
    assert length["meta_info"]["finish_reason"] == schedule_batch.FINISH_LENGTH(3).to_json()
    aborted = out(FinishReason.ABORTED, (7,))["meta_info"]["finish_reason"]
    assert aborted["type"] == schedule_batch.FINISH_ABORT("x").to_json()["type"]
    meta = stop["meta_info"]
    # What slime's rollout reads from a /generate answer.
    assert [t for _, t, _ in meta["output_token_logprobs"]] == list(stop["output_ids"])
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [-0.5, -0.5]
    assert meta["weight_version"] == "3" and isinstance(stop["text"], str)
    for key in ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct"):
        assert isinstance(meta[key], int)
