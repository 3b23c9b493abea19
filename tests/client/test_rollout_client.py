"""RolloutClient / AsyncRolloutClient against a real daemon: jobs, policy pushes, typed errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from tests.api.support import (
    ADMIN_TOKEN,
    TRAINER_TOKEN,
    DaemonThread,
    make_settings,
    seed_devices,
    write_model_dir,
)
from tltd.domain import (
    Backend,
    FinishReason,
    Job,
    LogprobMode,
    RolloutRequest,
    TokenProvenance,
    TokenSource,
)
from tltd.domain import SamplingParams as DomainSampling
from tltd.v1 import admin_pb2, common_pb2, rollout_pb2
from tltd_clients import (
    AsyncRolloutClient,
    RolloutClient,
    RolloutSample,
    SamplingParams,
    TltClientError,
    by_prompt,
)
from tltd_clients.errors import (
    CallCancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    from_rpc_error,
)
from tltd_clients.rollout import _generate_request, _sample_from_pb, _sampling

_REQUEST = RolloutRequest("r", "job", ((1,),), DomainSampling(max_new_tokens=2))


@pytest.fixture
def daemon(sqlite_store, tmp_path) -> Iterator[DaemonThread]:
    seed_devices(sqlite_store)
    d = DaemonThread(make_settings(tmp_path, max_prompts_per_request=4), sqlite_store).start()
    yield d
    d.stop()


@pytest.fixture
def client(daemon) -> Iterator[RolloutClient]:
    with RolloutClient(daemon.target) as c:
        yield c


@pytest.fixture
def model_dir(tmp_path):
    return write_model_dir(tmp_path / "model")


def test_create_job_binds_the_client_and_is_idempotent(client, model_dir):
    info = client.create_job(model_dir, job_id="grpo-1", speculative="off")
    assert (info.job_id, info.status, info.policy_version, info.speculative) == (
        "grpo-1",
        "active",
        0,
        "off",
    )
    assert client.job_id == "grpo-1"
    assert client.create_job(model_dir, job_id="grpo-1", speculative="off") == info
    assert client.job() == info
    assigned = RolloutClient(client.raw.target)
    assert assigned.create_job(model_dir).job_id not in ("", "grpo-1")


def test_update_policy_returns_increasing_versions(client, model_dir, tmp_path):
    client.create_job(model_dir, job_id="j")
    assert client.update_policy(write_model_dir(tmp_path / "step-1"), note="step 1") == 1
    assert client.update_policy(write_model_dir(tmp_path / "step-2")) == 2
    assert client.job().policy_version == 2


def test_update_policy_errors_are_typed(client, model_dir, tmp_path):
    with pytest.raises(ValueError, match="no job"):
        client.update_policy(tmp_path)
    client.create_job(model_dir, job_id="j")
    with pytest.raises(InvalidArgumentError) as info:
        client.update_policy(tmp_path / "missing")
    assert "checkpoint.path" in info.value.message
    with pytest.raises(NotFoundError):
        client.update_policy(model_dir, job_id="no-such-job")
    client.raw.cancel_job("j")
    with pytest.raises(FailedPreconditionError):
        client.update_policy(write_model_dir(tmp_path / "late"))


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "field"),
    [
        ([[1, 2]], {"max_new_tokens": 0}, InvalidArgumentError, "sampling.max_new_tokens"),
        ([[1, 2]], {"temperature": -1.0}, InvalidArgumentError, "sampling.temperature"),
        ([[1, 2], []], {}, InvalidArgumentError, "prompts[1].token_ids"),
        ([[1, 2], [3, 4, -5]], {}, InvalidArgumentError, "prompts[1].token_ids[2]"),
        ([], {}, InvalidArgumentError, "prompts"),
        ([[1]] * 5, {}, ResourceExhaustedError, "prompts"),
        ([[1, 2]], {"request_id": "bad id!"}, InvalidArgumentError, "request_id"),
    ],
)
def test_generate_rejections_name_the_field(client, model_dir, prompts, kwargs, error, field):
    client.create_job(model_dir, job_id="j")
    with pytest.raises(error) as info:
        client.generate(prompts, n=2, **kwargs)
    assert field in info.value.message, info.value.message
    assert client.job().status == "active"  # the daemon keeps serving


def test_generate_job_errors(client, model_dir):
    with pytest.raises(ValueError, match="no job"):
        client.generate([[1, 2]])
    with pytest.raises(NotFoundError):
        client.generate([[1, 2]], job_id="nope")
    client.create_job(model_dir, job_id="j")
    client.raw.cancel_job("j")
    with pytest.raises(FailedPreconditionError, match="job_id"):
        client.generate([[1, 2]])


def test_generate_on_a_draining_node_is_unavailable(daemon, client, model_dir):
    client.create_job(model_dir, job_id="j")
    daemon.node.start_draining("test")
    with pytest.raises(UnavailableError, match="draining"):
        list(client.stream([[1, 2]]))


def test_client_side_argument_errors(client):
    client.job_id = "j"
    with pytest.raises(ValueError, match="speculative"):
        client.generate([[1]], speculative="fast")
    with pytest.raises(TypeError, match="temprature"):
        client.generate([[1]], temprature=1.0)
    # n=0 would travel as "unset" and come back as one sample per prompt.
    for n, sampling in ((0, None), (None, SamplingParams(n=0)), (-1, None)):
        with pytest.raises(ValueError, match="n must be >= 1"):
            client.generate([[1]], n, sampling=sampling)
        with pytest.raises(ValueError, match="n must be >= 1"):
            client.stream([[1]], n, sampling=sampling)  # checked before the first next()


def test_timeouts_and_internal_errors_are_typed(daemon, client, monkeypatch):
    with pytest.raises(DeadlineExceededError) as info:
        client.raw.call(client.raw.admin.GetStats, admin_pb2.GetStatsRequest(), timeout=1e-6)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    def broken():
        raise RuntimeError("a bug in the daemon")

    monkeypatch.setattr(daemon.services.admin, "stats", broken)
    with pytest.raises(InternalError, match="internal error"):
        client.raw.stats()


def test_timeout_none_is_no_deadline(daemon, monkeypatch):
    # `timeout or self.timeout` read an explicit None (no deadline) as the client's default.
    def slow(result):
        def call(*args):
            time.sleep(0.5)  # well past the client's 0.1 s
            return result

        return call

    monkeypatch.setattr(daemon.services.drafters, "export", slow(("/out", ["config.json"])))
    monkeypatch.setattr(daemon.services.rollouts, "cancel", slow(_REQUEST))
    with daemon.client(timeout=0.1) as raw:
        # A long call: no deadline unless given.
        assert raw.export_drafter("job", 1, "/out").path == "/out"
        with pytest.raises(DeadlineExceededError):
            raw.export_drafter("job", 1, "/out", timeout=0.1)
        assert raw.cancel_request("r", timeout=None).request_id == "r"
        with pytest.raises(DeadlineExceededError):
            raw.cancel_request("r")  # the client's timeout


def test_every_status_has_one_mapping():
    class Failed(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "why"

    cases = {
        grpc.StatusCode.CANCELLED: CallCancelledError,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
        grpc.StatusCode.INTERNAL: InternalError,
        grpc.StatusCode.UNAVAILABLE: UnavailableError,
        grpc.StatusCode.DATA_LOSS: TltClientError,  # no class of its own: the base
    }
    for code, cls in cases.items():
        err = from_rpc_error(Failed(code))
        assert type(err) is cls and err.code == code and err.message == "why"


def test_logprob_mode_and_provenance_keywords():
    params = _sampling(2, None, {"logprob_mode": "raw", "return_provenance": True})
    assert params.logprob_mode is LogprobMode.RAW and params.return_provenance
    req = _generate_request("j", [[1]], params, None, None)
    assert req.sampling.logprob_mode == rollout_pb2.LOGPROB_MODE_RAW
    assert req.sampling.return_provenance
    default = _generate_request("j", [[1]], _sampling(1, None, {}), None, None).sampling
    assert default.logprob_mode == rollout_pb2.LOGPROB_MODE_PROCESSED
    assert not default.return_provenance
    with pytest.raises(ValueError, match="logprob_mode must be 'processed' or 'raw'"):
        _sampling(1, None, {"logprob_mode": "tempered"})


def test_raw_logprobs_and_provenance_need_the_torch_backend(client, sqlite_store, model_dir):
    """An sglang job returns SGLang's logprobs and knows no per-token provenance: asking for
    either is refused by name, before anything is stored."""
    sqlite_store.jobs.create(Job("sg", str(model_dir), backend=Backend.SGLANG))
    with pytest.raises(FailedPreconditionError, match="sampling.logprob_mode: .*torch backend"):
        client.generate([[1]], job_id="sg", max_new_tokens=2, logprob_mode="raw")
    with pytest.raises(FailedPreconditionError, match="sampling.return_provenance"):
        client.generate([[1]], job_id="sg", max_new_tokens=2, return_provenance=True)
    assert sqlite_store.requests.list(job_id="sg") == []


def test_sampling_keywords_override_the_params_object():
    base = SamplingParams(n=4, temperature=0.0, max_new_tokens=16, seed=3)
    assert _sampling(None, base, {}) == base
    assert _sampling(8, base, {"temperature": 1.0}) == SamplingParams(
        n=8, temperature=1.0, max_new_tokens=16, seed=3
    )
    req = _generate_request("j", [(1, 2), [3]], _sampling(2, None, {"seed": 0}), None, "off")
    assert req.sampling.HasField("seed") and req.sampling.seed == 0
    assert not req.sampling.HasField("top_p") or req.sampling.top_p == 1.0
    assert [list(p.token_ids) for p in req.prompts] == [[1, 2], [3]]
    assert req.speculative == common_pb2.SPECULATIVE_MODE_OFF
    assert _generate_request("j", [[1]], base, "r1", None).speculative == (
        common_pb2.SPECULATIVE_MODE_UNSPECIFIED
    )


def test_samples_become_plain_values_grouped_per_prompt():
    pbs = [
        rollout_pb2.Sample(
            request_id="r",
            prompt_index=p,
            sample_index=i,
            token_ids=[5, 6, 2],
            logprobs=[-0.5, -0.25, -0.125],
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
            policy_version=3,
            drafter_version=1,
            speculative=rollout_pb2.SpeculativeStats(
                draft_steps=1, plain_steps=1, accepted_tokens=1, mean_accepted_length=2.0
            ),
        )
        for p, i in [(1, 1), (0, 1), (1, 0), (0, 0)]
    ]
    samples = [_sample_from_pb(pb) for pb in pbs]
    s = samples[0]
    assert isinstance(s, RolloutSample) and s.finish_reason == "stop"
    assert s.finish_reason is FinishReason.STOP
    assert (s.token_ids, s.logprobs, s.num_tokens) == ([5, 6, 2], [-0.5, -0.25, -0.125], 3)
    assert (s.policy_version, s.drafter_version, s.mean_accepted_length) == (3, 1, 2.0)
    groups = by_prompt(samples)
    assert [[(x.prompt_index, x.sample_index) for x in g] for g in groups] == [
        [(0, 0), (0, 1)],
        [(1, 0), (1, 1)],
    ]
    unknown = _sample_from_pb(rollout_pb2.Sample(finish_reason=99))
    assert unknown.finish_reason is FinishReason.FAILED
    assert s.provenance is None and s.sd_step_share == 0.5


def test_sd_counters_and_provenance_become_plain_values():
    pb = rollout_pb2.Sample(
        token_ids=[5, 6, 7, 8],
        speculative=rollout_pb2.SpeculativeStats(
            draft_steps=1, plain_steps=1, accepted_tokens=1, drafted_tokens=2, residual_tokens=1
        ),
        provenance=rollout_pb2.TokenProvenance(
            source=[
                rollout_pb2.TOKEN_SOURCE_PLAIN,
                rollout_pb2.TOKEN_SOURCE_PLAIN,
                rollout_pb2.TOKEN_SOURCE_ACCEPTED,
                rollout_pb2.TOKEN_SOURCE_RESIDUAL,
            ],
            drafter=[0, 0, rollout_pb2.DRAFTER_KIND_NGRAM, rollout_pb2.DRAFTER_KIND_NGRAM],
            draft_length=[0, 0, 2, 2],
        ),
    )
    s = _sample_from_pb(pb)
    assert (s.drafted_tokens, s.residual_tokens, s.bonus_tokens) == (2, 1, 0)
    assert s.provenance == [
        TokenProvenance(TokenSource.PLAIN),
        TokenProvenance(TokenSource.PLAIN),
        TokenProvenance(TokenSource.ACCEPTED, "ngram", 2),
        TokenProvenance(TokenSource.RESIDUAL, "ngram", 2),
    ]
    # A source this client does not know (a newer daemon's): not read as a plain token.
    pb.provenance.source.append(42)
    pb.provenance.drafter.append(0)
    pb.provenance.draft_length.append(0)
    with pytest.raises(ValueError, match="unknown token source 42"):
        _sample_from_pb(pb)


def test_async_client(daemon, model_dir, tmp_path):
    async def scenario() -> None:
        async with AsyncRolloutClient(daemon.target) as client:
            info = await client.create_job(model_dir, job_id="aj")
            assert info.job_id == client.job_id == "aj"
            assert await client.update_policy(write_model_dir(tmp_path / "s1")) == 1
            assert (await client.job()).policy_version == 1
            with pytest.raises(InvalidArgumentError, match="sampling.max_new_tokens"):
                await client.generate([[1, 2]], n=2, max_new_tokens=0)
            with pytest.raises(NotFoundError):
                async for _ in client.stream([[1]], job_id="missing"):
                    pass
            with pytest.raises(InvalidArgumentError, match="checkpoint.path"):
                await client.update_policy(tmp_path / "missing")

    asyncio.run(scenario())


def test_tokens_reach_the_daemon(sqlite_store, tmp_path, model_dir):
    seed_devices(sqlite_store)
    tokens = {ADMIN_TOKEN: "admin", TRAINER_TOKEN: "trainer"}
    d = DaemonThread(make_settings(tmp_path, tokens=tokens), sqlite_store).start()
    try:
        with RolloutClient(d.target) as anonymous:
            with pytest.raises(UnauthenticatedError):
                anonymous.create_job(model_dir)
        with RolloutClient(d.target, token=TRAINER_TOKEN) as trainer:
            assert trainer.create_job(model_dir, job_id="t").job_id == "t"
            assert trainer.update_policy(write_model_dir(tmp_path / "s1")) == 1
            with pytest.raises(PermissionDeniedError):
                trainer.raw.cordon("cpu:0")

        async def anonymous_async() -> None:
            async with AsyncRolloutClient(d.target, "t") as client:
                await client.job()

        with pytest.raises(UnauthenticatedError) as info:
            asyncio.run(anonymous_async())
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        d.stop()
