"""Property-based fuzzing of every RPC against a real daemon (real rollout worker, SQLite).

Requests are generated from each method's input descriptor (tests/reliability/
descriptor_fuzz.py), as messages and as raw bytes no message object can hold. Invariants
after every case: the status is one a caller can act on (never INTERNAL, UNKNOWN or
UNIMPLEMENTED, except UpdatePolicy's declared but unimplemented tensor and NCCL
sources), an INVALID_ARGUMENT names a field of the request (or "request" for bytes
that do not decode), and the daemon is still SERVING. After each method's run a valid
rollout of another job still completes with every sample.

What the fuzzer leaves out, and why: real device ids (cordoning or draining the node's only
device makes later rollouts UNAVAILABLE by design; tests/api covers those RPCs) and
Drain(node=true) (it shuts the daemon down by design). Random text for `output_dir` never
starts with "/" so no export writes outside the test's directories.
"""

from __future__ import annotations

import collections
import time

import grpc
import pytest
from google.protobuf import symbol_database
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.support import make_settings, seed_devices
from tests.reliability.descriptor_fuzz import (
    field_names,
    messages,
    mutations,
    named_field,
    raw_requests,
)
from tests.rollout.support import InProcessDaemon, make_checkpoint
from tltd.domain import RequestStatus
from tltd.store import Store
from tltd.store.migrate import upgrade
from tltd.v1 import admin_pb2, drafter_pb2, job_pb2, policy_pb2, rollout_pb2, session_pb2

C = grpc.StatusCode
ALLOWED = {
    C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION,
    C.RESOURCE_EXHAUSTED, C.OUT_OF_RANGE, C.UNAVAILABLE, C.ABORTED,
}  # fmt: skip
GENERATE_SECONDS = 1.0  # an accepted rollout streams this long, then the test cancels it

METHODS = [
    m
    for module in (admin_pb2, drafter_pb2, job_pb2, policy_pb2, rollout_pb2, session_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for m in service.methods
]
_DB = symbol_database.Default()


def _cls(desc):
    return _DB.GetSymbol(desc.full_name)


def _excluded(method, data: bytes) -> bool:
    """Requests left out by design (module docstring): whole-node drain, real devices."""
    try:
        msg = _cls(method.input_type).FromString(data)
    except Exception:  # noqa: BLE001 - undecodable bytes are always sent
        return False
    if method.name == "Drain" and msg.node:
        return True
    if method.name == "CancelJob" and msg.job_id == "fuzz-job":
        return True  # the job the other methods fuzz stays active ("fuzz-cancel" is for this)
    device = getattr(msg, "device_id", "")
    return method.name in ("Cordon", "Drain", "Uncordon") and device.startswith("cpu:0")


def _templates(ckpt2, tmp) -> dict:
    """A valid request of each method (mutations start from these)."""
    sampling = rollout_pb2.SamplingParams(n=2, max_new_tokens=8, seed=3, temperature=1.0)
    return {
        "CreateJob": job_pb2.CreateJobRequest(model_path=str(ckpt2), weight=1.0),
        "GetJob": job_pb2.GetJobRequest(job_id="fuzz-job"),
        "CancelJob": job_pb2.CancelJobRequest(job_id="fuzz-cancel", reason="fuzz"),
        "ListJobs": job_pb2.ListJobsRequest(statuses=[1], limit=5),
        "Generate": rollout_pb2.GenerateRequest(
            job_id="fuzz-job", prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3])], sampling=sampling
        ),
        "GetRequest": rollout_pb2.GetRequestRequest(request_id="fuzz-r1", include_samples=True),
        "CancelRequest": rollout_pb2.CancelRequestRequest(request_id="fuzz-r1"),
        "UpdatePolicy": policy_pb2.UpdatePolicyRequest(
            job_id="fuzz-job", checkpoint=policy_pb2.CheckpointSource(path=str(ckpt2))
        ),
        "GetPolicy": policy_pb2.GetPolicyRequest(job_id="fuzz-job"),
        "GetPush": policy_pb2.GetPushRequest(job_id="fuzz-job", update_id="fuzz-push"),
        # One message of a push stream: the header (it announces one of the model's tensors).
        "PushPolicy": policy_pb2.PushPolicyRequest(
            header=policy_pb2.PushHeader(
                job_id="fuzz-job",
                update_id="fuzz-push",
                tensors=[policy_pb2.TensorSpec(name="model.norm.weight", dtype="F32", shape=[32])],
            )
        ),
        "ListDrafters": drafter_pb2.ListDraftersRequest(job_id="fuzz-job"),
        "GetDrafter": drafter_pb2.GetDrafterRequest(job_id="fuzz-job", version=1),
        "PinDrafter": drafter_pb2.PinDrafterRequest(job_id="fuzz-job", version=0),
        "ExportDrafter": drafter_pb2.ExportDrafterRequest(
            job_id="fuzz-job", version=1, output_dir=str(tmp / "export")
        ),
        "OpenSession": session_pb2.OpenSessionRequest(
            job_id="fuzz-job", session_id="fuzz-s2", prompt_token_ids=[1, 2]
        ),
        "Turn": session_pb2.TurnRequest(
            session_id="fuzz-s",
            turn_index=0,
            input_token_ids=[3],
            sampling=rollout_pb2.SamplingParams(max_new_tokens=8, seed=3, temperature=1.0),
        ),
        "GetSession": session_pb2.GetSessionRequest(session_id="fuzz-s"),
        "CloseSession": session_pb2.CloseSessionRequest(session_id="fuzz-s2"),
        "Cordon": admin_pb2.CordonRequest(device_id="cpu:7"),
        "Uncordon": admin_pb2.UncordonRequest(device_id="cpu:7"),
        "Drain": admin_pb2.DrainRequest(device_id="cpu:7"),
    }


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory, ckpt, ckpt2):
    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{tmp / 'tltd.db'}"
    upgrade(url)
    store = Store(url)
    seed_devices(store, 1)
    settings_ = make_settings(
        tmp, cpu_slots=1, worker_max_batch=16, worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0, drafter_training=False,
    )  # fmt: skip
    d = InProcessDaemon(settings_, store).start()
    bad = make_checkpoint(tmp / "other", vocab=64)
    (tmp / "afile").write_text("x")
    with d.client() as c:
        c.create_job(str(ckpt), job_id="fuzz-job")
        c.create_job(str(ckpt), job_id="probe")
        c.create_job(str(ckpt), job_id="fuzz-cancel")
        c.open_session("fuzz-job", [1, 2, 3], session_id="fuzz-s")
    pools = {
        "job_id": ["fuzz-job"] * 6 + ["fuzz-cancel", "", "no-such-job"],
        "request_id": ["", "fuzz-r1", "fuzz-r2"],
        "session_id": ["fuzz-s", "fuzz-s2", "", "no-such-session"],
        "model_path": [str(ckpt), str(ckpt2), str(bad), str(tmp / "afile"), "/no/such"],
        "path": [str(ckpt2), str(ckpt), str(bad), str(tmp / "afile"), "/no/such"],
        "initial_drafter_path": [str(ckpt), str(tmp / "afile"), "/no/such"],
        "output_dir": [str(tmp / "export"), str(tmp / "afile"), "relative/dir"],
        "device_id": ["", "cpu:7", "cuda:0", "gpu"],
        "token_ids": list(range(48)),
        "max_new_tokens": [1, 4, 16, 64],
        "version": [0, 1, 2, 3],
    }
    counts: collections.Counter = collections.Counter()
    templates = _templates(ckpt2, tmp)
    with grpc.insecure_channel(d.target) as channel:
        yield d, store, channel, pools, counts, templates
    d.kill()
    store.close()


def _call(channel, method, data: bytes) -> tuple[C, str]:
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path)(data, timeout=GENERATE_SECONDS)
            for _ in stream:
                pass
        else:
            channel.unary_unary(path)(data, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return C.OK, ""


def _cancel_open_rollouts(store, channel) -> None:
    """Accepted fuzz rollouts are cancelled so they do not pile up on the one worker."""
    cancel = channel.unary_unary("/tltd.v1.RolloutService/CancelRequest")
    open_ = store.requests.list([RequestStatus.QUEUED, RequestStatus.RUNNING], limit=None)
    for r in open_:
        if r.job_id != "probe":
            req = rollout_pb2.CancelRequestRequest(request_id=r.request_id, reason="fuzz cleanup")
            try:
                cancel(req.SerializeToString(), timeout=30)
            except grpc.RpcError as exc:  # it ended between the listing and the cancel
                assert exc.code() == C.FAILED_PRECONDITION, exc


def _expected_special(method, code: C, details: str) -> bool:
    """A rollout still streaming when the test's deadline ends it; UpdatePolicy from tensors or
    NCCL, arms the API reserves and the daemon refuses as not implemented (documented: they
    point to PushPolicy and OpenBroadcast)."""
    if method.server_streaming and code == C.DEADLINE_EXCEEDED:
        return True
    return (
        method.name == "UpdatePolicy"
        and code == C.UNIMPLEMENTED
        and details.startswith(("UpdatePolicy from tensors", "UpdatePolicy from nccl"))
    )


def _check_case(env, method, data: bytes) -> None:
    d, store, channel, _, counts, _ = env
    code, details = _call(channel, method, data)
    counts[(method.name, code.name)] += 1
    if code == C.INVALID_ARGUMENT:
        counts[(method.name, "field:" + str(named_field(details)))] += 1
    assert code in ALLOWED or _expected_special(method, code, details), (
        method.name, data.hex(), code, details,
    )  # fmt: skip
    if code == C.INVALID_ARGUMENT:
        named = named_field(details)
        assert named in field_names(method.input_type) | {"request"}, (method.name, details)
    if method.server_streaming:
        _cancel_open_rollouts(store, channel)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _probe_rollout(d) -> None:
    """A valid request of another job still completes, every sample of it."""
    with d.client() as c:
        sampling = rollout_pb2.SamplingParams(n=2, max_new_tokens=4, seed=1)
        samples = list(c.generate("probe", [[1, 2, 3], [4, 5]], sampling=sampling, timeout=120))
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (0, 0), (0, 1), (1, 0), (1, 1),
    ]  # fmt: skip


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_rpc_survives_generated_requests(fuzz_env, method, size, figures):
    """Random messages and raw bytes of `method`'s request type: allowed statuses only,
    INVALID_ARGUMENT names a field, the daemon keeps serving, valid work still completes."""
    d, store, channel, pools, counts, templates = fuzz_env
    examples = {"short": 50, "long": 600}[size]
    big = {"prompts": 64, "token_ids": 900, "stop_token_ids": 256, "shape": 8, "statuses": 64}
    msgs = messages(method.input_type, _cls, pools, big)
    raw = raw_requests(method.input_type, msgs)
    kinds = [msgs, msgs]  # random messages; one in three cases raw bytes
    if method.name in templates:  # and mutations of a valid request, as often as the rest
        kinds += [mutations(templates[method.name], _cls, pools, big)] * 3
    serialized = st.one_of(kinds).map(lambda m: m.SerializeToString())
    cases = st.one_of(serialized, serialized, raw).filter(lambda b: not _excluded(method, b))
    before = collections.Counter(counts)
    started = time.monotonic()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=size == "short",  # CI: the same cases every run; by hand: new ones
        suppress_health_check=list(HealthCheck),
    )
    @given(cases)
    def run(data: bytes) -> None:
        _check_case(fuzz_env, method, data)

    run()
    _probe_rollout(d)
    mine = {k[1]: v for k, v in (counts - before).items() if k[0] == method.name}
    by_status = {k: v for k, v in mine.items() if not k.startswith("field:")}
    figures.update(
        cases=sum(by_status.values()),
        by_status=by_status,
        invalid_fields={k[6:]: v for k, v in mine.items() if k.startswith("field:")},
        seconds=round(time.monotonic() - started, 1),
    )
