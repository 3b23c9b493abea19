"""The cases the SGLang contract environment checks against the real sglang
(tests/sglang_contract/http_cases.json) stay true of tltd: it accepts every body, the field
lists are exactly the fields it takes, the finish reasons are what it returns."""

from __future__ import annotations

import json
from pathlib import Path

from tltd.domain import FinishReason, Job, RolloutRequest, Sample, SamplingParams
from tltd.http import door, sglang_api, sglang_control, sglang_sessions, sglang_weights
from tltd.http.vocab import Vocab

CASES = json.loads(
    (Path(__file__).resolve().parents[1] / "sglang_contract" / "http_cases.json").read_text()
)


class _CharVocab(Vocab):
    """Text bodies need a tokenizer: one id per character will do for acceptance."""

    def __init__(self) -> None:
        super().__init__(tokenizer=object(), eos_ids=())

    def encode(self, text, field):
        return tuple(ord(c) % 50 for c in text)

    def stop_token(self, text, field):
        return 2


def test_tltd_accepts_every_body():
    for body in CASES["generate_bodies"] + list(CASES["framework_bodies"].values()):
        parsed = door.parse(sglang_api.GenerateRequest, json.dumps(body).encode())
        req, _params, _single = sglang_api.to_rollout(parsed, Job("j", "/m"), _CharVocab(), "")
        assert req.prompts and req.sampling.max_new_tokens > 0


def test_tltd_accepts_every_session_body():
    cases = CASES["sessions"]
    for body in (cases["open_rids"], cases["open_streaming"]):
        door.parse(sglang_sessions.OpenSessionRequest, json.dumps(body).encode())
    for body in cases["close"]:
        door.parse(sglang_sessions.CloseSessionRequest, json.dumps(body).encode())
    for body in cases["turns_rids"] + cases["turns_streaming"]:
        parsed = door.parse(sglang_api.GenerateRequest, json.dumps(body).encode())
        sglang_sessions.SessionParams.model_validate(parsed.session_params)
        sglang_api.parse_sampling(parsed.sampling_params)


def test_the_field_lists_are_the_fields_tltd_takes():
    fields = CASES["fields"]
    assert fields["GenerateReqInput"] == sorted(sglang_api.GenerateRequest.model_fields)
    assert fields["SamplingParams"] == sorted(sglang_api.SglangSampling.model_fields)
    assert fields["UpdateWeightFromDiskReqInput"] == sorted(
        sglang_api.UpdateWeightsRequest.model_fields
    )
    legacy = set(CASES["legacy_fields"]["UpdateWeightsFromDistributedReqInput"])
    ours = {
        "InitWeightsUpdateGroupReqInput": sglang_weights.InitGroupRequest,
        "UpdateWeightsFromDistributedReqInput": sglang_weights.UpdateFromDistributedRequest,
        "DestroyWeightsUpdateGroupReqInput": sglang_weights.DestroyGroupRequest,
        "PauseGenerationReqInput": sglang_control.PauseRequest,
        "ContinueGenerationReqInput": sglang_control.ContinueRequest,
        "AbortReq": sglang_control.AbortRequest,
        "OpenSessionReqInput": sglang_sessions.OpenSessionRequest,
        "CloseSessionReqInput": sglang_sessions.CloseSessionRequest,
        "SessionParams": sglang_sessions.SessionParams,
    }
    for struct, model in ours.items():
        assert fields[struct] == sorted(set(model.model_fields) - legacy), struct


def test_the_finish_reasons_are_what_tltd_returns():
    req = RolloutRequest("r", "j", ((1, 2),), SamplingParams(n=1, stop_token_ids=(2,)))
    body = door.parse(sglang_api.GenerateRequest, b'{"input_ids": [1, 2]}')

    def finish(reason, ids):
        s = Sample("r", 0, 0, ids, tuple(-0.5 for _ in ids), reason)
        out = sglang_api.output(body, sglang_api.SglangSampling(), req, s, Vocab(None, ()))
        return out["meta_info"]["finish_reason"]

    assert CASES["finish_reasons"] == {
        "matched_token_2": finish(FinishReason.STOP, (7, 2)),
        "length_3": finish(FinishReason.LENGTH, (7, 8, 9)),
    }
