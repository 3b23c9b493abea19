"""Every RPC through a real gRPC server and channel, on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import grpc
import pytest

from tests.api.support import (
    VOCAB,
    DaemonThread,
    fails,
    make_settings,
    sampling,
    write_checkpoint,
    write_model_dir,
)
from tltd.domain import (
    DrafterStatus,
    DrafterVersion,
    FinishReason,
    JobStatus,
    RequestStatus,
    RolloutRequest,
    Sample,
    SamplingParams,
)
from tltd.v1 import common_pb2, drafter_pb2, job_pb2, policy_pb2, rollout_pb2
from tltd_clients.errors import NotFoundError, TltClientError

C = grpc.StatusCode


# ---- jobs ------------------------------------------------------------------------------------


def test_create_get_list_cancel_job(client, model_dir):
    job = client.create_job(str(model_dir), job_id="job-a", name="grpo run", weight=2.5)
    assert job.job_id == "job-a"
    assert job.status == job_pb2.JOB_STATUS_ACTIVE
    assert job.backend == common_pb2.BACKEND_TORCH  # settings.default_backend
    assert job.weight == 2.5 and job.policy_version == 0 and job.drafter_version == 0
    assert job.speculative.batch_threshold == 32  # 0 -> settings.spec_batch_threshold
    assert job.speculative.mode == common_pb2.SPECULATIVE_MODE_AUTO
    assert job.HasField("created_at")
    assert client.get_job("job-a") == job
    # Idempotent on job_id: a retried create returns the same job.
    assert client.create_job(str(model_dir), job_id="job-a", name="grpo run", weight=2.5) == job
    with fails(C.ALREADY_EXISTS):
        client.create_job(str(model_dir), job_id="job-a", name="another run")

    auto = client.create_job(str(model_dir))
    assert auto.job_id.startswith("job-") and auto.weight == 1.0  # weight 0 -> 1.0
    assert {j.job_id for j in client.list_jobs()} == {"job-a", auto.job_id}

    cancelled = client.cancel_job("job-a", "done")
    assert cancelled.status == job_pb2.JOB_STATUS_CANCELLED and "done" in cancelled.status_reason
    assert client.cancel_job("job-a").status == job_pb2.JOB_STATUS_CANCELLED  # no-op
    active = client.list_jobs([job_pb2.JOB_STATUS_ACTIVE])
    assert [j.job_id for j in active] == [auto.job_id]
    assert len(client.list_jobs(limit=1)) == 1
    # Dropping these widened the filter to every job.
    with fails(C.INVALID_ARGUMENT, "statuses[0]"):
        client.list_jobs([job_pb2.JOB_STATUS_UNSPECIFIED])
    with fails(C.INVALID_ARGUMENT, "statuses[1]"):
        client.list_jobs([job_pb2.JOB_STATUS_ACTIVE, 9])


def test_create_job_with_speculative_config(client, model_dir):
    spec = common_pb2.SpeculativeConfig(
        mode=common_pb2.SPECULATIVE_MODE_OFF,
        batch_threshold=8,
        draft_lengths=[3, 5],
        drafter="ngram",
        online_training=False,
    )
    job = client.create_job(str(model_dir), job_id="spec", speculative=spec)
    assert job.speculative == spec
    assert client.get_job("spec").speculative == spec


BAD_CREATE_JOB = [
    ({"model_path": ""}, C.INVALID_ARGUMENT, "model_path"),
    ({"model_path": "/nonexistent/model"}, C.INVALID_ARGUMENT, "model_path"),
    ({"weight": -1.0}, C.INVALID_ARGUMENT, "weight"),
    ({"weight": math.nan}, C.INVALID_ARGUMENT, "weight"),
    ({"job_id": "bad id with spaces"}, C.INVALID_ARGUMENT, "job_id"),
    ({"backend": common_pb2.BACKEND_SGLANG}, C.FAILED_PRECONDITION, "sglang"),
    (
        {"speculative": common_pb2.SpeculativeConfig(drafter="magic")},
        C.INVALID_ARGUMENT,
        "speculative.drafter",
    ),
    (
        {"speculative": common_pb2.SpeculativeConfig(draft_lengths=[4, 0])},
        C.INVALID_ARGUMENT,
        "speculative.draft_lengths[1]",
    ),
    (
        {"speculative": common_pb2.SpeculativeConfig(draft_lengths=[65])},
        C.INVALID_ARGUMENT,
        "speculative.draft_lengths[0]",
    ),
    (  # a repeated length would be a second bandit arm of the same strategy
        {"speculative": common_pb2.SpeculativeConfig(draft_lengths=[2, 4, 4])},
        C.INVALID_ARGUMENT,
        "speculative.draft_lengths[2]",
    ),
    # Numbers and strings the store's columns cannot hold: named, not INTERNAL.
    ({"weight": math.inf}, C.INVALID_ARGUMENT, "weight"),
    ({"name": "x" * 257}, C.INVALID_ARGUMENT, "name"),
    ({"job_id": "job\n"}, C.INVALID_ARGUMENT, "job_id"),  # `$` matched before the newline
    # Unknown enum values: refused, not read as the default.
    ({"backend": 7}, C.INVALID_ARGUMENT, "backend"),
    (
        {"speculative": common_pb2.SpeculativeConfig(mode=5)},
        C.INVALID_ARGUMENT,
        "speculative.mode",
    ),
]


def test_create_job_rejects(client, model_dir):
    for kwargs, code, field in BAD_CREATE_JOB:
        kwargs = {"model_path": str(model_dir)} | kwargs
        with fails(code, field):
            client.create_job(kwargs.pop("model_path"), **kwargs)
    assert client.list_jobs() == []  # nothing half-created


def test_create_job_takes_the_whole_uint32_range(client, model_dir):
    """priority and speculative.batch_threshold are uint32: beyond a signed SQL INTEGER."""
    top = 2**32 - 1
    spec = common_pb2.SpeculativeConfig(batch_threshold=top)
    job = client.create_job(str(model_dir), job_id="job", priority=top, speculative=spec)
    assert job.priority == top and job.speculative.batch_threshold == top
    assert client.get_job("job") == job
    assert client.list_jobs(limit=top) == [job]


def test_create_job_needs_config_json(client, tmp_path):
    (tmp_path / "empty").mkdir()
    with fails(C.INVALID_ARGUMENT, "model_path", "config.json"):
        client.create_job(str(tmp_path / "empty"))


def test_create_job_needs_a_config_json_object(client, tmp_path):
    # Valid JSON that is not an object passed, then broke every Generate with INTERNAL.
    for name, text in (("list", "[1, 2]"), ("broken", "{")):
        path = write_model_dir(tmp_path / name)
        (path / "config.json").write_text(text)
        with fails(C.INVALID_ARGUMENT, "model_path", "config.json"):
            client.create_job(str(path))
    assert client.list_jobs() == []
    # Replaced after CreateJob: no token check then, but not INTERNAL either.
    path = write_model_dir(tmp_path / "replaced")
    client.create_job(str(path), job_id="job")
    (path / "config.json").write_text('{"text_config": [1]}')
    with fails(C.UNIMPLEMENTED, "no rollout workers"):
        _generate(client, prompts=[[VOCAB]], sampling=sampling())


def test_vocab_size_is_read_again_after_a_failed_read(client, model_dir):
    client.create_job(str(model_dir), job_id="job")
    config = (model_dir / "config.json").read_text()
    # Unreadable for a moment (a write in progress): no token check.
    (model_dir / "config.json").write_text("{")
    with fails(C.UNIMPLEMENTED, "no rollout workers"):
        _generate(client, prompts=[[VOCAB]], sampling=sampling())
    # Readable again: the failed read was not cached, so the vocabulary is checked.
    (model_dir / "config.json").write_text(config)
    with fails(C.INVALID_ARGUMENT, "prompts[0].token_ids[0]"):
        _generate(client, prompts=[[VOCAB]], sampling=sampling())


def test_unknown_job(client):
    with fails(C.NOT_FOUND, "job_id"):
        client.get_job("nope")
    with fails(C.NOT_FOUND, "job_id"):
        client.cancel_job("nope")


# ---- rollouts: validation of every field ------------------------------------------------------


def _generate(client, job_id="job", prompts=((1, 2, 3),), **kw):
    return list(client.generate(job_id, prompts, **kw))


# (prompts, sampling params, expected code, the field the message must start with)
BAD_GENERATE = [
    ([], {}, C.INVALID_ARGUMENT, "prompts"),
    ([[1, 2], []], {}, C.INVALID_ARGUMENT, "prompts[1].token_ids"),
    ([[1, -5, 2]], {}, C.INVALID_ARGUMENT, "prompts[0].token_ids[1]"),
    ([[1, 2, VOCAB]], {}, C.INVALID_ARGUMENT, "prompts[0].token_ids[2]"),
    ([[1]], {"max_new_tokens": 0}, C.INVALID_ARGUMENT, "sampling.max_new_tokens"),
    ([[1]], {"max_new_tokens": 10**6}, C.INVALID_ARGUMENT, "sampling.max_new_tokens"),
    ([[1]], {"temperature": -0.5}, C.INVALID_ARGUMENT, "sampling.temperature"),
    ([[1]], {"temperature": math.nan}, C.INVALID_ARGUMENT, "sampling.temperature"),
    ([[1]], {"temperature": math.inf}, C.INVALID_ARGUMENT, "sampling.temperature"),
    ([[1]], {"top_p": 0.0}, C.INVALID_ARGUMENT, "sampling.top_p"),
    ([[1]], {"top_p": 1.5}, C.INVALID_ARGUMENT, "sampling.top_p"),
    ([[1]], {"top_p": math.nan}, C.INVALID_ARGUMENT, "sampling.top_p"),
    ([[1]], {"top_k": -2}, C.INVALID_ARGUMENT, "sampling.top_k"),
    ([[1]], {"stop_token_ids": [3, -1]}, C.INVALID_ARGUMENT, "sampling.stop_token_ids[1]"),
    ([[1]] * 3, {"n": 4}, C.RESOURCE_EXHAUSTED, "sampling.n"),  # 12 > 10 samples
    ([[1]] * 6, {}, C.RESOURCE_EXHAUSTED, "prompts"),  # 6 > 5 prompts
    ([[1] * 65], {}, C.INVALID_ARGUMENT, "prompts[0].token_ids"),  # > 64 tokens
    # No room left in a worker's 32-token sequence (not UNAVAILABLE once it reaches one).
    ([[1], [1] * 32], {}, C.INVALID_ARGUMENT, "prompts[1].token_ids"),
    ([[1]], {"temperature": 1e-40}, C.INVALID_ARGUMENT, "sampling.temperature"),  # NaN logprobs
    # Prompt + max_new_tokens beyond the worker's 32 tokens: refused, not cut short (LENGTH).
    ([[1] * 30], {"max_new_tokens": 3}, C.INVALID_ARGUMENT, "sampling.max_new_tokens"),
    ([[1], [1] * 25], {"max_new_tokens": 8}, C.INVALID_ARGUMENT, "sampling.max_new_tokens"),
]


def test_generate_rejects_each_bad_field(store, tmp_path, model_dir):
    settings = make_settings(
        tmp_path,
        max_samples_per_request=10,
        max_prompts_per_request=5,
        max_prompt_tokens=64,
        max_new_tokens_limit=1000,
        worker_max_seq_len=32,
    )
    # One daemon for the whole table: a fresh PostgreSQL database per case costs a second.
    d = DaemonThread(settings, store).start()
    try:
        with d.client() as client:
            client.create_job(str(model_dir), job_id="job")
            for prompts, params, code, field in BAD_GENERATE:
                case = f"{field} with prompts={prompts!r:.40} {params}"
                with pytest.raises(TltClientError) as info:
                    _generate(client, prompts=prompts, sampling=sampling(**params))
                assert info.value.code == code, (case, info.value)
                assert info.value.message.startswith(f"{field}: "), (case, info.value.message)
            # The daemon keeps serving after rejections, and nothing was stored.
            assert client.get_job("job").job_id == "job"
            assert client.stats().requests_by_status.get("queued", 0) == 0
    finally:
        d.stop()


def test_generate_job_checks(client, model_dir):
    with fails(C.INVALID_ARGUMENT, "job_id"):
        _generate(client, job_id="", sampling=sampling())
    with fails(C.NOT_FOUND, "job_id"):
        _generate(client, job_id="ghost", sampling=sampling())
    client.create_job(str(model_dir), job_id="job")
    with fails(C.INVALID_ARGUMENT, "job_id"):
        _generate(client, job_id="job\n", sampling=sampling())
    with fails(C.INVALID_ARGUMENT, "request_id"):
        _generate(client, sampling=sampling(), request_id="r\n")
    with fails(C.INVALID_ARGUMENT, "speculative: unknown value 3"):  # was read as "inherit"
        _generate(client, sampling=sampling(), speculative=3)
    client.cancel_job("job")
    with fails(C.FAILED_PRECONDITION, "job_id", "cancelled"):
        _generate(client, sampling=sampling())


def test_generate_checks_the_context_against_the_model_and_the_worker(client, tmp_path):
    """prompt + max_new_tokens must fit the model's positions and a worker's sequence
    (worker_max_seq_len, default 2304): refused at admission, naming the field, instead of a
    sample cut short and marked LENGTH."""
    import json

    def model(name: str, positions: int) -> str:
        path = write_model_dir(tmp_path / name)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(
            json.dumps(config | {"max_position_embeddings": positions})
        )
        return str(path)

    client.create_job(model("policy", 2304), job_id="job")
    prompt = [[1] * 40]
    with fails(C.UNIMPLEMENTED, "no rollout workers"):  # a rollout's usual shape: admitted
        _generate(client, prompts=prompt, sampling=sampling(max_new_tokens=2048))
    with fails(C.UNIMPLEMENTED, "no rollout workers"):  # exactly full
        _generate(client, prompts=prompt, sampling=sampling(max_new_tokens=2264))
    with fails(C.INVALID_ARGUMENT, "sampling.max_new_tokens: ", "at most 2264"):
        _generate(client, prompts=prompt, sampling=sampling(max_new_tokens=32768))
    with fails(C.INVALID_ARGUMENT, "prompts[1].token_ids: ", "2304"):
        _generate(client, prompts=[[1], [1] * 2304], sampling=sampling())
    # A model with fewer positions than a worker holds: its own limit counts.
    client.create_job(model("short", 64), job_id="short")
    with fails(C.INVALID_ARGUMENT, "prompts[0].token_ids: ", "positions for 64"):
        _generate(client, "short", prompts=[[1] * 64], sampling=sampling(max_new_tokens=1))
    with fails(C.INVALID_ARGUMENT, "sampling.max_new_tokens: ", "positions for 64"):
        _generate(client, "short", prompts=prompt, sampling=sampling(max_new_tokens=25))
    with fails(C.UNIMPLEMENTED, "no rollout workers"):
        _generate(client, "short", prompts=prompt, sampling=sampling(max_new_tokens=24))


def test_generate_takes_every_uint64_seed(client, model_dir):
    client.create_job(str(model_dir), job_id="job")
    for seed in (2**63, 2**64 - 1):  # half of all random 64-bit seeds
        with fails(C.UNIMPLEMENTED, "no rollout workers"):
            _generate(client, sampling=sampling(seed=seed))


def test_undecodable_request_bytes_are_invalid_argument(daemon):
    """Bytes that are no message of the method's type are the caller's error, not UNKNOWN."""
    with grpc.insecure_channel(daemon.target) as channel:
        # No serializers: the raw bytes go on the wire as given.
        get_job = channel.unary_unary("/tltd.v1.JobService/GetJob")
        generate = channel.unary_stream("/tltd.v1.RolloutService/Generate")
        for call, data in (
            (get_job, bytes.fromhex("0a02fffe")),  # job_id: invalid UTF-8
            (get_job, bytes.fromhex("0a05616263")),  # job_id: 5 bytes announced, 3 sent
            (lambda b, **kw: list(generate(b, **kw)), bytes.fromhex("1202fffe")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(data, timeout=10)
            assert info.value.code() == C.INVALID_ARGUMENT, info.value
            assert info.value.details().startswith("request: does not decode"), info.value
        with pytest.raises(grpc.RpcError) as info:  # still serving
            get_job(job_pb2.GetJobRequest(job_id="x").SerializeToString(), timeout=10)
        assert info.value.code() == C.NOT_FOUND


def test_valid_generate_is_unimplemented_without_workers(client, model_dir):
    client.create_job(str(model_dir), job_id="job")
    # Defaults: n 0 -> 1, top_p unset -> 1, top_k -1 -> disabled; all valid. This API-only
    # daemon has no supervisor (tests/rollout runs real workers).
    with fails(C.UNIMPLEMENTED, "no rollout workers"):
        _generate(client, prompts=[[1, 2], [3]], sampling=sampling(top_k=-1, temperature=0.7))


def test_get_and_cancel_stored_request(client, daemon, model_dir):
    client.create_job(str(model_dir), job_id="job")
    req = RolloutRequest(
        request_id="req-1",
        job_id="job",
        prompts=((1, 2), (3,)),
        sampling=SamplingParams(n=2, temperature=0.5, max_new_tokens=4, seed=7),
    )
    daemon.store.requests.create(req)
    daemon.store.samples.add(
        Sample(
            request_id="req-1",
            prompt_index=0,
            sample_index=1,
            token_ids=(5, 6),
            logprobs=(-0.5, -0.25),
            finish_reason=FinishReason.LENGTH,
        )
    )
    got = client.get_request("req-1", include_samples=True)
    assert got.request.status == rollout_pb2.REQUEST_STATUS_QUEUED
    assert got.request.num_prompts == 2 and got.request.samples_total == 4
    assert got.request.sampling.seed == 7 and got.request.sampling.n == 2
    assert [(s.prompt_index, s.sample_index, list(s.token_ids)) for s in got.samples] == [
        (0, 1, [5, 6])
    ]
    assert list(got.samples[0].logprobs) == [-0.5, -0.25]
    assert got.samples[0].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    assert client.get_request("req-1").samples == []

    cancelled = client.cancel_request("req-1", "trainer gave up")
    assert cancelled.status == rollout_pb2.REQUEST_STATUS_CANCELLED
    assert client.cancel_request("req-1").status == rollout_pb2.REQUEST_STATUS_CANCELLED
    with fails(C.NOT_FOUND, "request_id"):
        client.get_request("req-missing")
    with fails(C.NOT_FOUND, "request_id"):
        client.cancel_request("req-missing")
    with fails(C.INVALID_ARGUMENT, "request_id"):
        client.get_request("")


def test_cancel_job_cancels_its_open_requests(client, daemon, model_dir):
    client.create_job(str(model_dir), job_id="job")
    daemon.store.requests.create(
        RolloutRequest(
            request_id="r", job_id="job", prompts=((1,),), sampling=SamplingParams(max_new_tokens=2)
        )
    )
    client.cancel_job("job")
    assert daemon.store.requests.get("r").status is RequestStatus.CANCELLED


def test_cancel_job_leaves_a_request_that_ended_alone(client, daemon, model_dir):
    # r1 completed before CancelJob (the requests are read and cancelled under their row
    # locks, in one transaction, so none can end in between): r1 keeps its status, r2 and r3
    # are cancelled.
    store = daemon.store
    client.create_job(str(model_dir), job_id="job")
    req = RolloutRequest("r", "job", ((1,),), SamplingParams(max_new_tokens=2))
    for rid in ("r1", "r2", "r3"):
        store.requests.create(replace(req, request_id=rid))
    store.requests.set_status("r1", RequestStatus.RUNNING, "running")
    store.requests.set_status("r1", RequestStatus.COMPLETED, "all samples finished")
    assert client.cancel_job("job", "stop").status == job_pb2.JOB_STATUS_CANCELLED
    status = {rid: store.requests.get(rid).status for rid in ("r1", "r2", "r3")}
    assert status == {
        "r1": RequestStatus.COMPLETED,
        "r2": RequestStatus.CANCELLED,
        "r3": RequestStatus.CANCELLED,
    }
    assert store.requests.get("r2").status_reason == "job cancelled: stop"


def test_cancel_job_again_cancels_requests_left_open(client, daemon, model_dir):
    # A daemon killed in the middle of CancelJob leaves the job cancelled and some requests
    # open: a retried CancelJob cancels them (with the reason the job was cancelled for).
    store = daemon.store
    client.create_job(str(model_dir), job_id="job")
    store.requests.create(RolloutRequest("r", "job", ((1,),), SamplingParams(max_new_tokens=2)))
    store.jobs.set_status("job", JobStatus.CANCELLED, "first")
    assert store.requests.get("r").status is RequestStatus.QUEUED
    job = client.cancel_job("job", "second")
    assert job.status == job_pb2.JOB_STATUS_CANCELLED and job.status_reason == "first"
    got = store.requests.get("r")
    assert (got.status, got.status_reason) == (RequestStatus.CANCELLED, "job cancelled: first")


def test_cancel_job_cancels_more_than_a_thousand_open_requests(sqlite_store, tmp_path, model_dir):
    # SQLite only: 2000 short transactions take seconds more on PostgreSQL, and the defect
    # (`store.requests.list`' default limit of 1000) was the same on both.
    store = sqlite_store
    d = DaemonThread(make_settings(tmp_path), store).start()
    try:
        with d.client() as client:
            client.create_job(str(model_dir), job_id="job")
            req = RolloutRequest("r", "job", ((1,),), SamplingParams(max_new_tokens=2))
            for i in range(1001):
                store.requests.create(replace(req, request_id=f"r{i:04d}"))
            client.cancel_job("job")
    finally:
        d.stop()
    open_statuses = [RequestStatus.QUEUED, RequestStatus.RUNNING]
    assert store.requests.list(open_statuses, "job", limit=None) == []
    assert store.requests.get("r1000").status is RequestStatus.CANCELLED


# ---- policy ----------------------------------------------------------------------------------


def test_update_and_get_policy(client, model_dir, tmp_path):
    client.create_job(str(model_dir), job_id="job")
    initial = client.get_policy("job")
    assert initial.version == 0 and initial.source == "initial"
    ckpt = write_model_dir(tmp_path / "step-1")
    v1 = client.update_policy("job", str(ckpt), note="step 1")
    assert (v1.version, v1.source, v1.note) == (1, "checkpoint", "step 1")
    assert v1.path == str(ckpt.resolve())
    assert client.get_policy("job") == v1
    assert client.get_policy("job", 0) == initial
    assert client.get_job("job").policy_version == 1
    with fails(C.NOT_FOUND):
        client.get_policy("job", 9)
    for version in (2**31, 2**63, 2**64 - 1):  # uint64: no such version (not INVALID_ARGUMENT)
        with fails(C.NOT_FOUND, "version"):
            client.get_policy("job", version)


def test_update_policy_compares_llama_configs_as_the_engine_reads_them(client, tmp_path):
    """A `head_dim` written out by a newer transformers is the implied one (accepted); a
    changed `rope_theta` is another model (refused: every worker's load would fail)."""

    base = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip

    def model(name: str, **extra) -> str:
        return str(write_checkpoint(tmp_path / name, base | extra))

    client.create_job(model("m0"), job_id="job")
    assert client.update_policy("job", model("m1", head_dim=16)).version == 1
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "rope_theta"):
        client.update_policy("job", model("m2", rope_theta=500000.0))
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "num_layers"):
        client.update_policy("job", model("m3", num_hidden_layers=3))
    assert client.get_job("job").policy_version == 1


def test_update_policy_rejects(client, model_dir, tmp_path):
    client.create_job(str(model_dir), job_id="job")
    call = client.call
    stub = client.policy.UpdatePolicy
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "config.json"):
        (tmp_path / "no-config").mkdir()
        client.update_policy("job", str(tmp_path / "no-config"))
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "safetensors"):
        client.update_policy("job", str(write_model_dir(tmp_path / "no-w", weights=False)))
    with fails(C.INVALID_ARGUMENT, "checkpoint.path"):
        client.update_policy("job", str(tmp_path / "missing"))
    # Another architecture cannot replace the workers' tensors one by one: refused up front.
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "vocab_size"):
        client.update_policy("job", str(write_model_dir(tmp_path / "resized", vocab=VOCAB + 8)))
    assert client.get_job("job").policy_version == 0
    with fails(C.INVALID_ARGUMENT, "source"):
        call(stub, policy_pb2.UpdatePolicyRequest(job_id="job"))
    tensors = policy_pb2.TensorSource(tensors=[policy_pb2.NamedTensor(name="w")])
    with fails(C.UNIMPLEMENTED, "tensors", "PushPolicy"):
        call(stub, policy_pb2.UpdatePolicyRequest(job_id="job", tensors=tensors))
    nccl = policy_pb2.NcclSource(master_address="10.0.0.1", master_port=1234, world_size=2)
    with fails(C.UNIMPLEMENTED, "nccl", "OpenBroadcast"):
        call(stub, policy_pb2.UpdatePolicyRequest(job_id="job", nccl=nccl))
    with fails(C.NOT_FOUND, "job_id"):
        client.update_policy("ghost", str(model_dir))
    client.cancel_job("job")
    with fails(C.FAILED_PRECONDITION, "job_id"):
        client.update_policy("job", str(model_dir))
    assert client.get_policy("job").version == 0  # nothing recorded by the failures


# ---- drafters --------------------------------------------------------------------------------


def test_drafters_list_get_pin(client, daemon, model_dir):
    client.create_job(str(model_dir), job_id="job")
    listed = client.list_drafters("job")
    assert list(listed.drafters) == [] and listed.active_version == 0
    for version, status in ((1, DrafterStatus.PROMOTED), (2, DrafterStatus.PROMOTED)):
        daemon.store.drafters.add(
            DrafterVersion(
                job_id="job",
                version=version,
                policy_version=0,
                path=f"/d/{version}",
                train_steps=100 * version,
                loss=0.5 / version,
                acceptance_length=2.0 + version,
            )
        )
        daemon.store.drafters.set_status("job", version, status, "evaluated")
    listed = client.list_drafters("job")
    assert [v.version for v in listed.drafters] == [1, 2] and listed.active_version == 2
    v1 = client.get_drafter("job", 1)
    assert v1.train_steps == 100 and v1.status == drafter_pb2.DRAFTER_STATUS_PROMOTED
    assert not v1.active

    pinned = client.pin_drafter("job", 1)
    assert pinned.active_version == 1 and pinned.drafter.version == 1 and pinned.drafter.pinned
    assert client.get_drafter("job", 1).active
    assert client.get_job("job").drafter_version == 1
    unpinned = client.pin_drafter("job", 0)
    assert unpinned.active_version == 2 and not unpinned.HasField("drafter")

    with fails(C.NOT_FOUND, "version"):
        client.get_drafter("job", 7)
    with fails(C.NOT_FOUND, "version"):
        client.pin_drafter("job", 7)
    with fails(C.INVALID_ARGUMENT, "version"):
        client.get_drafter("job", 0)
    for version in (2**31, 2**63, 2**64 - 1):  # uint64: no such version (not INVALID_ARGUMENT)
        with fails(C.NOT_FOUND, "version"):
            client.get_drafter("job", version)
        with fails(C.NOT_FOUND, "version"):
            client.pin_drafter("job", version)
    with fails(C.NOT_FOUND, "job_id"):
        client.list_drafters("ghost")
    with fails(C.NOT_FOUND, "version"):
        client.export_drafter("job", 9, "/tmp/out")
    with fails(C.FAILED_PRECONDITION, "version", "/d/1"):  # its checkpoint is gone
        client.export_drafter("job", 1, "/tmp/out")


def test_export_drafter_writes_an_sglang_eagle_checkpoint(client, daemon, tmp_path):
    import json

    from safetensors.torch import load_file

    from tests.rollout.support import make_checkpoint
    from tltd_workers.engine.eagle import EagleDrafter
    from tltd_workers.engine.transformer import load_model

    target = make_checkpoint(tmp_path / "policy")
    EagleDrafter.random_init(load_model(target), seed=1).save_pretrained(tmp_path / "drafter")
    client.create_job(str(target), job_id="job")
    daemon.store.drafters.add(
        DrafterVersion(job_id="job", version=0, policy_version=0, path=str(tmp_path / "drafter"))
    )
    out = tmp_path / "export"
    with fails(C.INVALID_ARGUMENT, "format"):
        client.export_drafter("job", 1, str(out), "onnx")
    with fails(C.INVALID_ARGUMENT, "output_dir"):
        client.export_drafter("job", 1, "")
    # Relative: it would land under the daemon's working directory.
    with fails(C.INVALID_ARGUMENT, "output_dir", "absolute"):
        client.export_drafter("job", 1, "export")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad in (a_file, a_file / "sub"):  # not a directory; cannot be created
        with fails(C.INVALID_ARGUMENT, "output_dir: ", str(bad)):
            client.export_drafter("job", 1, str(bad))
    resp = client.export_drafter("job", 1, str(out))
    assert resp.path == str(out) and set(resp.files) == {"config.json", "model.safetensors"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in tensors and "fc.weight" in tensors
    assert not any("lm_head" in k for k in tensors)


# ---- free text -------------------------------------------------------------------------------


def test_text_with_nul_or_too_long_is_refused_by_name(client, daemon, model_dir, tmp_path):
    # PostgreSQL text cannot hold NUL (it was INTERNAL there, stored by SQLite): refused by
    # name on both, as is text beyond its bound; nothing is changed.
    nul, long_reason = "a\x00b", "x" * 1025
    with fails(C.INVALID_ARGUMENT, "name", "NUL"):
        client.create_job(str(model_dir), job_id="job", name=nul)
    with fails(C.INVALID_ARGUMENT, "name", "256"):
        client.create_job(str(model_dir), job_id="job", name="x" * 257)
    with fails(C.INVALID_ARGUMENT, "model_path", "NUL"):
        client.create_job(str(model_dir) + "\x00")
    client.create_job(str(model_dir), job_id="job", name="y" * 256)
    daemon.store.requests.create(
        RolloutRequest("r", "job", ((1,),), SamplingParams(max_new_tokens=2))
    )
    for reason in (nul, long_reason):
        with fails(C.INVALID_ARGUMENT, "reason"):
            client.cancel_request("r", reason)
        with fails(C.INVALID_ARGUMENT, "reason"):
            client.cancel_job("job", reason)
        with fails(C.INVALID_ARGUMENT, "reason"):
            client.cordon("cpu:0", reason)
        with fails(C.INVALID_ARGUMENT, "note"):
            client.update_policy("job", str(write_model_dir(tmp_path / "step-1")), note=reason)
    with fails(C.INVALID_ARGUMENT, "checkpoint.path", "NUL"):
        client.update_policy("job", str(tmp_path / "step-1") + "\x00")
    daemon.store.drafters.add(
        DrafterVersion(job_id="job", version=0, policy_version=0, path="/d/1")
    )
    with fails(C.INVALID_ARGUMENT, "output_dir", "NUL"):
        client.export_drafter("job", 1, str(tmp_path / "out") + "\x00")
    assert daemon.store.requests.get("r").status is RequestStatus.QUEUED
    assert client.get_job("job").status == job_pb2.JOB_STATUS_ACTIVE
    assert client.get_policy("job").version == 0
    assert not client.list_devices()[0].cordoned
    # At the bound: accepted.
    assert client.cancel_job("job", "z" * 1024).status_reason == "z" * 1024


# ---- admin -----------------------------------------------------------------------------------


def test_devices_cordon_uncordon_drain(client):
    devices = client.list_devices()
    assert [d.device_id for d in devices] == ["cpu:0", "cpu:1"]
    assert devices[0].kind == "cpu" and devices[0].state == "idle"

    d = client.cordon("cpu:0", "bad fan")
    assert d.cordoned and not d.draining
    stats = client.stats()
    assert (stats.devices, stats.devices_schedulable) == (2, 1)
    d = client.uncordon("cpu:0")
    assert not d.cordoned
    drained = client.drain("cpu:1")
    assert [x.device_id for x in drained] == ["cpu:1"] and drained[0].draining
    assert not client.stats().draining  # one device, not the node
    assert not client.uncordon("cpu:1").draining

    with fails(C.NOT_FOUND, "device_id"):
        client.cordon("cuda:9")
    with fails(C.INVALID_ARGUMENT, "device_id"):
        client.cordon("")
    with fails(C.INVALID_ARGUMENT, "device_id"):
        client.drain("cpu:0", node=True)
    with fails(C.INVALID_ARGUMENT, "grace_seconds", "node drain only"):  # was ignored
        client.drain("cpu:0", grace_seconds=5)
    assert not client.list_devices()[0].draining
    with fails(C.NOT_FOUND, "device_id"):
        client.list_workers("cuda:9")
    assert client.list_workers() == [] and client.list_workers("cpu:0") == []


def test_drain_node_refuses_new_rollouts(client, model_dir):
    client.create_job(str(model_dir), job_id="job")
    drained = client.drain(node=True)
    assert {d.device_id for d in drained} == {"cpu:0", "cpu:1"}
    assert all(d.draining for d in drained)
    stats = client.stats()
    assert stats.draining and stats.devices_schedulable == 0
    with fails(C.UNAVAILABLE, "draining"):
        _generate(client, sampling=sampling())
    assert client.get_job("job").job_id == "job"  # reads still work
    # Health tells load balancers: no rollouts here, the rest of the API still serves.
    assert client.health("tltd.v1.RolloutService") == "NOT_SERVING"
    assert client.health("tltd.v1.JobService") == "SERVING" and client.health() == "SERVING"


def test_stats(client, daemon, model_dir):
    client.create_job(str(model_dir), job_id="job")
    daemon.store.requests.create(
        RolloutRequest(
            request_id="r", job_id="job", prompts=((1,),), sampling=SamplingParams(max_new_tokens=2)
        )
    )
    stats = client.stats()
    assert stats.version and stats.uptime_seconds > 0
    assert stats.database == daemon.store.dialect
    assert stats.jobs_active == 1 and stats.devices == 2 and stats.workers == 0
    assert stats.requests_by_status["queued"] == 1
    assert stats.samples_total == 0 and not stats.draining


# ---- the error boundary ----------------------------------------------------------------------


def test_unexpected_errors_become_internal_and_are_logged(
    client, daemon, model_dir, caplog, monkeypatch
):
    client.create_job(str(model_dir), job_id="job")

    def boom(*_a, **_k):
        raise RuntimeError("secret detail that must not reach the client")

    monkeypatch.setattr(daemon.services.jobs, "get", boom)
    monkeypatch.setattr(daemon.services.rollouts, "prepare", boom)
    with caplog.at_level(logging.ERROR, logger="tltd.api.interceptors"):
        with fails(C.INTERNAL, "internal error (see daemon log)") as info:
            client.get_job("job")
        assert "secret" not in info.value.message
        with fails(C.INTERNAL, "internal error (see daemon log)"):  # server-streaming too
            _generate(client, sampling=sampling())
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 2 and "secret detail" in str(logged[0].exc_info[1])
    assert "GetJob" in logged[0].getMessage() and "Generate" in logged[1].getMessage()
    monkeypatch.undo()
    assert client.get_job("job").job_id == "job"  # still serving


def test_not_found_error_type(client):
    with pytest.raises(NotFoundError):
        client.get_job("ghost")
