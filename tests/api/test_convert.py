"""The proto <-> domain converter: defaults, enums (every member), timestamps."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest

from tltd import domain as d
from tltd.api import convert as c
from tltd.errors import InvalidArgument
from tltd.v1 import common_pb2, drafter_pb2, job_pb2, policy_pb2, rollout_pb2


def test_sampling_defaults():
    s = c.sampling_from_pb(rollout_pb2.SamplingParams(max_new_tokens=5))
    assert (s.n, s.top_p, s.top_k, s.temperature, s.seed) == (1, 1.0, 0, 0.0, None)
    assert c.sampling_from_pb(rollout_pb2.SamplingParams(top_k=-1)).top_k == 0
    assert (
        c.sampling_from_pb(rollout_pb2.SamplingParams(top_k=-7)).top_k == -7
    )  # left to validation
    assert c.sampling_from_pb(rollout_pb2.SamplingParams(top_k=40)).top_k == 40
    # Explicitly set top_p = 0 is not "unset": validation must see it.
    assert c.sampling_from_pb(rollout_pb2.SamplingParams(top_p=0.0)).top_p == 0.0
    assert c.sampling_from_pb(rollout_pb2.SamplingParams(seed=0)).seed == 0
    pb = rollout_pb2.SamplingParams(
        n=3, temperature=0.5, top_p=0.5, top_k=8, max_new_tokens=9, stop_token_ids=[2, 3], seed=11
    )
    # Logprob mode UNSPECIFIED is the documented default, processed; provenance is off.
    s = c.sampling_from_pb(pb)
    assert (s.logprob_mode, s.return_provenance) == (d.LogprobMode.PROCESSED, False)
    pb.logprob_mode = rollout_pb2.LOGPROB_MODE_PROCESSED
    assert c.sampling_to_pb(c.sampling_from_pb(pb)) == pb
    pb.logprob_mode, pb.return_provenance = rollout_pb2.LOGPROB_MODE_RAW, True
    s = c.sampling_from_pb(pb)
    assert (s.logprob_mode, s.return_provenance) == (d.LogprobMode.RAW, True)
    assert c.sampling_to_pb(s) == pb


def test_rollout_request_and_speculative_override():
    pb = rollout_pb2.GenerateRequest(
        job_id="j",
        request_id="r",
        prompts=[rollout_pb2.Prompt(token_ids=[1, 2])],
        sampling=rollout_pb2.SamplingParams(n=2, max_new_tokens=3),
    )
    req, spec = c.rollout_from_pb(pb)
    assert req.prompts == ((1, 2),) and req.samples_total == 2 and spec is None
    pb.speculative = common_pb2.SPECULATIVE_MODE_OFF
    assert c.rollout_from_pb(pb)[1] is d.SpeculativeMode.OFF
    out = c.rollout_to_pb(req)
    assert (out.num_prompts, out.samples_total, out.status) == (
        1,
        2,
        rollout_pb2.REQUEST_STATUS_QUEUED,
    )


@pytest.mark.parametrize(
    ("enum", "to_pb", "pb_enum"),
    [
        (d.JobStatus, c.job_status_to_pb, job_pb2.JobStatus),
        (d.RequestStatus, c.request_status_to_pb, rollout_pb2.RequestStatus),
        (d.DrafterStatus, c.drafter_status_to_pb, drafter_pb2.DrafterStatus),
        (d.LogprobMode, c._LOGPROB_MODE_PB.get, rollout_pb2.LogprobMode),
        (d.TokenSource, c._TOKEN_SOURCE_PB.get, rollout_pb2.TokenSource),
    ],
)
def test_every_domain_enum_member_has_a_proto_value(enum, to_pb, pb_enum):
    values = {to_pb(m) for m in enum}
    assert len(values) == len(enum) and 0 not in values
    assert {pb_enum.Name(v).rsplit("_", 1)[-1].lower() for v in values} == {m.value for m in enum}


def test_backend_and_mode_unspecified_mean_default():
    assert c.backend_from_pb(common_pb2.BACKEND_UNSPECIFIED) is None
    assert c.backend_from_pb(common_pb2.BACKEND_SGLANG) is d.Backend.SGLANG
    assert c.speculative_mode_from_pb(common_pb2.SPECULATIVE_MODE_UNSPECIFIED, "m") is None
    assert c.job_statuses_from_pb([]) == []  # all
    assert c.job_statuses_from_pb([job_pb2.JOB_STATUS_FAILED]) == [d.JobStatus.FAILED]


def test_unknown_enum_values_are_refused_by_name():
    # A newer client's member (or garbage) is not read as the default / dropped from a filter.
    with pytest.raises(InvalidArgument, match="backend: unknown value 7"):
        c.new_job_from_pb(job_pb2.CreateJobRequest(model_path="/m", backend=7))
    spec = common_pb2.SpeculativeConfig(mode=9)
    with pytest.raises(InvalidArgument, match="speculative.mode: unknown value 9"):
        c.new_job_from_pb(job_pb2.CreateJobRequest(model_path="/m", speculative=spec))
    with pytest.raises(InvalidArgument, match="speculative: unknown value 3"):
        c.rollout_from_pb(rollout_pb2.GenerateRequest(job_id="j", speculative=3))
    bad_mode = rollout_pb2.SamplingParams(logprob_mode=5)
    with pytest.raises(InvalidArgument, match="sampling.logprob_mode: unknown value 5"):
        c.rollout_from_pb(rollout_pb2.GenerateRequest(job_id="j", sampling=bad_mode))
    # [UNSPECIFIED] read as "no filter" listed every job.
    with pytest.raises(InvalidArgument, match=r"statuses\[1\]: JOB_STATUS_UNSPECIFIED"):
        c.job_statuses_from_pb([job_pb2.JOB_STATUS_FAILED, job_pb2.JOB_STATUS_UNSPECIFIED])
    with pytest.raises(InvalidArgument, match=r"statuses\[0\]: unknown value 8"):
        c.job_statuses_from_pb([8])


def test_new_job_defaults():
    new = c.new_job_from_pb(job_pb2.CreateJobRequest(model_path="/m"))
    assert new.backend is None and new.speculative is None and new.weight == 0.0
    new = c.new_job_from_pb(
        job_pb2.CreateJobRequest(
            model_path="/m", speculative=common_pb2.SpeculativeConfig(drafter="eagle")
        )
    )
    assert new.speculative.drafter == "eagle" and new.speculative.batch_threshold == 0
    assert new.speculative.draft_lengths == d.SpeculativeConfig().draft_lengths
    assert new.speculative.initial_drafter_path == ""


def test_initial_drafter_path_round_trips():
    spec = d.SpeculativeConfig(initial_drafter_path="/drafters/fitted")
    pb = c.speculative_to_pb(spec)
    assert pb.initial_drafter_path == "/drafters/fitted"
    assert c.speculative_from_pb(pb) == spec


def test_timestamps_are_utc():
    naive = datetime(2026, 1, 2, 3, 4, 5, 600000)  # SQLite hands back naive UTC
    assert c.from_ts(c.ts(naive)) == naive.replace(tzinfo=UTC)
    aware = datetime(2026, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    assert c.from_ts(c.ts(aware)) == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert c.ts(None) is None
    assert not c.job_to_pb(d.Job(job_id="j", model_path="/m")).HasField("created_at")


def test_sample_round_trip():
    s = d.Sample(
        request_id="r",
        prompt_index=1,
        sample_index=2,
        token_ids=(4, 5),
        logprobs=(-0.5, -1.5),
        finish_reason=d.FinishReason.ABORTED,
        policy_version=3,
        drafter_version=1,
        speculative=d.SpeculativeStats(2, 3, 4, 2.5, 5, 1, 1),
        partial=True,
    )
    pb = c.sample_to_pb(s)
    assert not pb.HasField("provenance")  # not asked for: absent, not empty
    assert c.sample_from_pb(pb) == s
    assert pb.speculative.drafted_tokens == 5 and pb.speculative.bonus_tokens == 1
    P = d.TokenProvenance
    prov = (
        P(d.TokenSource.PLAIN),
        P(d.TokenSource.ACCEPTED, "eagle", 3),
        P(d.TokenSource.BONUS, "history", 16),
    )
    s = replace(s, provenance=prov, token_ids=(4, 5, 6), logprobs=(-0.5, -1.5, -0.25))
    pb = c.sample_to_pb(s)
    assert list(pb.provenance.source) == [
        rollout_pb2.TOKEN_SOURCE_PLAIN,
        rollout_pb2.TOKEN_SOURCE_ACCEPTED,
        rollout_pb2.TOKEN_SOURCE_BONUS,
    ]
    assert list(pb.provenance.drafter) == [
        rollout_pb2.DRAFTER_KIND_UNSPECIFIED,
        rollout_pb2.DRAFTER_KIND_EAGLE,
        rollout_pb2.DRAFTER_KIND_HISTORY,
    ]
    assert list(pb.provenance.draft_length) == [0, 3, 16]
    assert c.sample_from_pb(pb) == s
    assert c.sample_from_pb(c.sample_to_pb(replace(s, provenance=()))).provenance == ()
    pb.provenance.source[1] = 9
    with pytest.raises(InvalidArgument, match=r"provenance.source\[1\]: unknown token source"):
        c.sample_from_pb(pb)
    del pb.provenance.drafter[1]
    with pytest.raises(InvalidArgument, match="provenance: source, drafter and draft_length"):
        c.sample_from_pb(pb)


def test_top_and_prompt_logprobs_round_trip():
    """Asked for: every position's alternatives and the prompt's scores, -inf included (a
    token top-k excluded); not asked for: absent, not empty. Requests carry the counts."""
    top = (d.TopLogprobs((4, 9), (-0.5, -1.0)), d.TopLogprobs((5, 4), (-0.25, float("-inf"))))
    prompt = d.PromptLogprobs((-2.0, -0.125), (3, 1), top)
    s = d.Sample("r", 0, 0, (4, 5), (-0.5, -0.25), d.FinishReason.LENGTH)
    pb = c.sample_to_pb(s)
    assert not pb.top_logprobs and not pb.HasField("prompt_logprobs")
    assert c.sample_from_pb(pb) == s
    full = replace(s, top_logprobs=top, prompt_logprobs=prompt)
    assert c.sample_from_pb(c.sample_to_pb(full)) == full
    one_token = replace(s, prompt_logprobs=d.PromptLogprobs((), ()))  # a one-token prompt
    assert c.sample_from_pb(c.sample_to_pb(one_token)) == one_token
    sp = d.SamplingParams(top_logprobs=5, prompt_logprobs=0)
    assert c.sampling_from_pb(c.sampling_to_pb(sp)) == sp
    assert c.sampling_from_pb(c.sampling_to_pb(d.SamplingParams())).prompt_logprobs is None


def test_policy_source():
    req = policy_pb2.UpdatePolicyRequest(
        job_id="j", checkpoint=policy_pb2.CheckpointSource(path="/c")
    )
    assert c.policy_source_from_pb(req) == ("checkpoint", "/c")
    assert c.policy_source_from_pb(policy_pb2.UpdatePolicyRequest(job_id="j")) == (None, "")
    req = policy_pb2.UpdatePolicyRequest(nccl=policy_pb2.NcclSource(world_size=2))
    assert c.policy_source_from_pb(req) == ("nccl", "")


def test_non_finite_floats_do_not_leak():
    v = d.DrafterVersion(job_id="j", version=1, policy_version=0, path="/p", loss=float("nan"))
    assert c.drafter_to_pb(v).loss == 0.0


def test_samples_sent_together_are_split_to_stay_under_the_message_bound():
    """`batch_samples`: a re-attach reads all of a request's samples at once; its messages
    stay under the bound (a sample larger than it goes alone), every sample once, in order."""
    samples = [
        d.Sample("r", p, i, tuple(range(200 * (1 + p))), (-0.5,) * 200 * (1 + p),
                 d.FinishReason.LENGTH)
        for p in range(4) for i in range(3)
    ]  # fmt: skip
    bound = 4_000
    msgs = list(c.generate_batch_responses(samples, max_bytes=bound))
    got = [(x.prompt_index, x.sample_index, len(x.token_ids)) for m in msgs for x in m.samples]
    assert got == [(s.prompt_index, s.sample_index, len(s.token_ids)) for s in samples]
    assert all(not m.HasField("sample") for m in msgs)
    assert 1 < len(msgs) < len(samples)
    for m in msgs:
        assert m.ByteSize() <= bound or len(m.samples) == 1
    assert any(m.ByteSize() > bound for m in msgs)  # the 800-token samples go alone
    assert len(list(c.generate_batch_responses(samples))) == 1  # the default bound: one
    assert list(c.generate_batch_responses([])) == []
