"""PushPolicy: weights in chunks, checked against the job's model before a byte is taken,
checksummed, resumable, deltas over a held version, a version only once all arrived."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.api.support import fails
from tests.rollout.support import make_checkpoint
from tltd.v1 import policy_pb2
from tltd_clients.errors import NotFoundError
from tltd_clients.push import Weights, header_pb, push_messages

C = grpc.StatusCode


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("policy") / "policy")


@pytest.fixture
def job(client, policy) -> Path:
    client.create_job(str(policy), job_id="job")
    return policy


def _weights(policy: Path, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The policy's tensors, moved by a seeded random step (new weights of the same model)."""
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(policy / "model.safetensors"))
    return {k: (v + 0.01 * torch.randn(v.shape, generator=g)).to(dtype) for k, v in sd.items()}


def _stored(client, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(client.get_policy("job", version).path) / "model.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical: same names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


def _held(client, update_id: str) -> int:
    try:
        return client.get_push("job", update_id).bytes_received
    except NotFoundError:
        return 0


def _stream(client, messages):
    try:
        return client.policy.PushPolicy(messages)
    except grpc.RpcError as exc:
        from tltd_clients.errors import from_rpc_error

        raise from_rpc_error(exc) from None


def test_push_round_trip_is_bit_identical_in_f32_and_bf16(client, job, tmp_path):
    for version, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        sd = _weights(job, seed=version, dtype=dtype)
        seen = []
        got = client.push_policy("job", sd, chunk_bytes=1000, progress=seen.append, note="step")
        assert got.policy.version == version and got.policy.source == "push"
        assert got.policy.note == "step"
        assert _same(_stored(client, version), sd)
        total = sum(v.numel() * v.element_size() for v in sd.values())
        assert seen[-1].bytes_done == seen[-1].bytes_total == total
        assert [p.bytes_done for p in seen] == sorted(p.bytes_done for p in seen)
        assert client.get_job("job").policy_version == version
    # A safetensors file is pushed as it is (read through mmap).
    path = tmp_path / "w.safetensors"
    sd = _weights(job, seed=3)
    save_file(sd, str(path))
    assert client.push_policy("job", path).policy.version == 3
    assert _same(_stored(client, 3), sd)
    # The version directory holds the job model's config beside the weights: a checkpoint.
    assert (Path(client.get_policy("job", 3).path) / "config.json").read_text() == (
        job / "config.json"
    ).read_text()


def test_the_trainer_client_pushes_and_pushes_deltas(daemon, job):
    from tltd_clients import RolloutClient

    v1 = _weights(job, seed=1, dtype=torch.bfloat16)
    v2 = _weights(job, seed=2, dtype=torch.bfloat16)
    with RolloutClient(daemon.target, job_id="job") as rc:
        assert rc.push_policy(v1) == 1
        assert rc.push_policy(v2, base_version=1, base_weights=v1) == 2
        with pytest.raises(ValueError, match="go together"):
            rc.push_policy(v2, base_version=1)
    with daemon.client() as c:
        assert _same(_stored(c, 2), v2)


def test_header_is_checked_against_the_job_model_before_any_byte(client, job):
    sd = _weights(job, seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = dict(sd) | {name: torch.zeros(3, 3)}
    with fails(C.INVALID_ARGUMENT, "header.tensors: ", name, "shape (3, 3)"):
        client.push_policy("job", wrong)
    missing = {k: v for k, v in sd.items() if k != name}
    with fails(C.INVALID_ARGUMENT, "header.tensors: ", f"{name} is missing"):
        client.push_policy("job", missing)
    with fails(C.NOT_FOUND, "job"):
        client.push_policy("nojob", sd)
    with fails(C.INVALID_ARGUMENT, "update_id: "):
        client.push_policy("job", sd, update_id="bad id!")
    # Nothing was recorded, and the daemon still takes a good push.
    assert client.get_job("job").policy_version == 0
    assert client.push_policy("job", sd).policy.version == 1


def test_corrupted_chunk_is_refused_naming_the_field_and_the_push_goes_on(client, job):
    sd = _weights(job, seed=1)
    w = Weights(sd)
    header = header_pb("job", "u1", w, "", None)

    def corrupt(messages):
        for i, m in enumerate(messages):
            if m.WhichOneof("part") == "chunk" and i == 3:
                data = bytearray(m.chunk.data)
                data[len(data) // 2] ^= 0x10  # one bit flipped in transit
                m.chunk.data = bytes(data)
            yield m

    with fails(C.INVALID_ARGUMENT, "chunk.crc32c: ", "CRC-32C"):
        _stream(client, corrupt(push_messages(header, w, {}, chunk_bytes=512)))
    # The chunks before the bad one are kept: the same push resumes from there.
    status = client.get_push("job", "u1")
    assert 0 < status.bytes_received < status.bytes_total
    assert client.get_job("job").policy_version == 0
    got = client.push_policy("job", sd, update_id="u1", chunk_bytes=512)
    assert got.policy.version == 1 and _same(_stored(client, 1), sd)


def test_chunks_are_checked_field_by_field(client, job):
    sd = _weights(job, seed=1)
    w = Weights(sd)
    name = next(iter(sd))
    header = header_pb("job", "u2", w, "", None)
    head = policy_pb2.PushPolicyRequest(header=header)

    def chunk(**kw):
        return policy_pb2.PushPolicyRequest(chunk=policy_pb2.TensorChunk(**kw))

    cases = [
        (chunk(name="nope", offset=0, length=4, data=b"abcd"), "chunk.name"),
        (chunk(name=name, offset=8, length=4, data=b"abcd"), "chunk.offset"),
        (chunk(name=name, offset=0, length=1 << 30, data=b"abcd"), "chunk.length"),
        (chunk(name=name, offset=0, length=8, data=b"abcd"), "chunk.data"),
        (chunk(name=name, offset=0, length=4, data=b"abcd", delta=True), "chunk.delta"),
    ]
    for bad, field in cases:
        with fails(C.INVALID_ARGUMENT, f"{field}: "):
            _stream(client, iter([head, bad]))
    with fails(C.INVALID_ARGUMENT, "header: "):
        _stream(client, iter([chunk(name=name, offset=0, length=4, data=b"abcd")]))
    with fails(C.FAILED_PRECONDITION, "commit: ", "incomplete"):
        _stream(client, iter([head, policy_pb2.PushPolicyRequest(commit=True)]))
    assert client.get_job("job").policy_version == 0


def test_a_broken_stream_is_resumed_where_it_stopped(client, job):
    sd = _weights(job, seed=1)
    w = Weights(sd)
    header = header_pb("job", "u3", w, "", None)
    total = sum(v.numel() * 4 for v in sd.values())

    def broken(messages, after: int):
        for i, m in enumerate(messages):
            if i == after:
                # Once the daemon holds some of it, the trainer's network goes away.
                while not _held(client, "u3"):
                    time.sleep(0.02)
                raise ConnectionError("the trainer's network went away")
            yield m

    with pytest.raises(Exception):  # noqa: B017 - grpc surfaces the iterator's failure
        client.policy.PushPolicy(broken(push_messages(header, w, {}, chunk_bytes=1024), 20))
    status = client.get_push("job", "u3")
    held = status.bytes_received
    assert 0 < held < total and status.bytes_total == total
    assert client.get_job("job").policy_version == 0
    seen = []
    got = client.push_policy("job", sd, update_id="u3", chunk_bytes=1024, progress=seen.append)
    assert got.policy.version == 1 and _same(_stored(client, 1), sd)
    assert seen[-1].wire_bytes == total - held  # only what was missing went again
    # The push is recorded: asking again answers with its version, nothing is re-sent.
    assert client.get_push("job", "u3").version == 1
    again = client.push_policy("job", sd, update_id="u3")
    assert again.policy.version == 1 and client.get_job("job").policy_version == 1
    # A resumed push must announce the same tensors.
    other = header_pb("job", "u4", w, "", None)
    client.policy.PushPolicy(push_messages(other, w, {}, chunk_bytes=1024, commit=False))
    changed = dict(sd) | {"lm_head.weight": torch.zeros(1)}
    with fails(C.INVALID_ARGUMENT, "header.tensors"):
        client.push_policy("job", changed, update_id="u4")


def test_delta_applied_equals_the_full_push(client, job):
    v1 = _weights(job, seed=1, dtype=torch.bfloat16)
    assert client.push_policy("job", v1).policy.version == 1
    # One small optimizer step on bf16 weights: most elements do not change at all.
    g = torch.Generator().manual_seed(7)
    v2 = {}
    for k, v in v1.items():
        step = 1e-3 * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.05)
        v2[k] = (v.float() + step).to(torch.bfloat16)
    full, delta = [], []
    d = client.push_policy(
        "job", v2, base_version=1, base_weights=v1, chunk_bytes=4096, progress=delta.append
    )
    f = client.push_policy("job", v2, chunk_bytes=4096, progress=full.append)
    assert (d.policy.version, f.policy.version) == (2, 3)
    assert _same(_stored(client, 2), v2) and _same(_stored(client, 2), _stored(client, 3))
    assert delta[-1].bytes_done == full[-1].bytes_done
    assert delta[-1].wire_bytes * 3 < full[-1].wire_bytes
    # A delta over a version whose weights are not what the trainer thinks fails on the
    # checksum of the result (version 3 holds v2, not v1).
    with fails(C.INVALID_ARGUMENT, "chunk.crc32c"):
        client.push_policy("job", v2, base_version=3, base_weights=v1)
    with fails(C.INVALID_ARGUMENT, "header.base_version: ", "same dtype"):
        client.push_policy("job", v2, base_version=0, base_weights=v1)  # v0 is F32
    with fails(C.NOT_FOUND, "header.base_version"):
        client.push_policy("job", v2, base_version=9, base_weights=v1)
    assert client.get_job("job").policy_version == 3


def test_an_abandoned_push_leaves_no_version_and_no_files(daemon, client, job):
    sd = _weights(job, seed=1)
    w = Weights(sd)
    header = header_pb("job", "u5", w, "", None)
    client.policy.PushPolicy(push_messages(header, w, {}, chunk_bytes=2048, commit=False))
    status = client.get_push("job", "u5")
    assert status.bytes_received == status.bytes_total and status.version == 0
    pushes = daemon.services.pushes
    staged = pushes.staging_root / "job" / "u5"
    assert staged.is_dir()
    assert pushes.collect(now=time.monotonic()) == []  # not idle long enough yet
    assert pushes.collect(now=time.monotonic() + pushes.idle_seconds + 1) == ["u5"]
    assert not staged.exists()
    with fails(C.NOT_FOUND, "update_id"):
        client.get_push("job", "u5")
    assert client.get_job("job").policy_version == 0
    assert not (pushes.versions_root / "job").exists()


def test_a_broadcast_the_trainer_never_joins_leaves_no_version(daemon, client, job, monkeypatch):
    from tltd.services import broadcast

    sd = _weights(job, seed=1)
    header = header_pb("job", "gone", Weights(sd), "", None)
    with fails(C.INVALID_ARGUMENT, "backend: ", "mpi"):
        client.call(
            client.policy.OpenBroadcast,
            policy_pb2.OpenBroadcastRequest(header=header, backend="mpi"),
        )
    # A torch without NCCL (this CPU build's answer, made certain): refused, nothing staged.
    monkeypatch.setattr(broadcast, "nccl_available", lambda: False)
    with fails(C.FAILED_PRECONDITION, "backend: ", "NCCL", "use gloo"):
        client.call(
            client.policy.OpenBroadcast,
            policy_pb2.OpenBroadcastRequest(header=header, backend="nccl"),
        )
    with fails(C.NOT_FOUND, "update_id"):
        client.get_push("job", "gone")
    delta = policy_pb2.PushHeader()
    delta.CopyFrom(header)
    delta.base_version = 0
    with fails(C.INVALID_ARGUMENT, "header.base_version: "):
        client.call(client.policy.OpenBroadcast, policy_pb2.OpenBroadcastRequest(header=delta))
    group = client.call(
        client.policy.OpenBroadcast,
        policy_pb2.OpenBroadcastRequest(header=header, timeout_seconds=1),
    )
    assert group.port > 0 and group.world_size == 2 and group.rank == 0
    assert group.backend == "gloo" and not group.HasField("workers")
    pushes = daemon.services.pushes
    deadline = time.monotonic() + 60
    while pushes._pushes["job", "gone"].attached:  # the group waits 1 s for the trainer
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with fails(C.FAILED_PRECONDITION, "commit: ", "incomplete"):
        _stream(
            client,
            iter(
                [
                    policy_pb2.PushPolicyRequest(header=header),
                    policy_pb2.PushPolicyRequest(commit=True),
                ]
            ),
        )
    assert client.get_job("job").policy_version == 0
    assert pushes.collect(time.monotonic() + pushes.idle_seconds + 1) == ["gone"]


def test_pushed_weights_beyond_the_newest_three_versions_are_deleted(client, job):
    sds = [_weights(job, seed=i, dtype=torch.bfloat16) for i in range(1, 6)]
    paths = [Path(client.push_policy("job", sd).policy.path) for sd in sds[:4]]
    assert not paths[0].exists() and all(p.is_dir() for p in paths[1:])
    assert (job / "model.safetensors").is_file()  # the job's own model is never touched
    assert [v.version for v in [client.get_policy("job", 1)]] == [1]  # its row stays
    with fails(C.FAILED_PRECONDITION, "header.base_version: ", "push in full"):
        client.push_policy("job", sds[4], base_version=1, base_weights=sds[0])
    got = client.push_policy("job", sds[4], base_version=4, base_weights=sds[3])
    assert got.policy.version == 5 and _same(_stored(client, 5), sds[4])
    assert not paths[1].exists() and paths[2].is_dir()


def test_abandoned_pushes_are_collected_by_a_declared_periodic_job(daemon, store):
    from tltd.periodic import build_scheduler, drop_abandoned_pushes

    scheduler = build_scheduler(daemon.settings, store, None, pushes=daemon.services.pushes)
    job = {j.id: j for j in scheduler.get_jobs()}["push-gc"]
    assert job.func is drop_abandoned_pushes and job.args == (daemon.services.pushes,)
    assert job.trigger.interval.total_seconds() == daemon.settings.push_gc_seconds


def test_a_retired_versions_file_is_reused_for_the_next_push_and_holds_only_its_bytes(
    daemon, client, job
):
    """The next push is staged over the weights file of the version retired last (same
    inode), grown or cut to its size, and the version it becomes holds exactly its tensors."""
    pushes = daemon.services.pushes
    recycled = pushes.recycle_root / "job.safetensors"
    dtypes = [torch.bfloat16] * 4 + [torch.float32] * 4 + [torch.bfloat16]
    for i, dtype in enumerate(dtypes, start=1):
        sd = _weights(job, seed=i, dtype=dtype)
        inode = recycled.stat().st_ino if recycled.exists() else None
        got = client.push_policy("job", sd, chunk_bytes=4096)
        assert got.policy.version == i
        weights = Path(got.policy.path) / "model.safetensors"
        assert (weights.stat().st_ino == inode) == (i >= 5), i  # v1 retires at v4's commit
        assert _same(load_file(str(weights)), sd), i
    # Version 9 (bf16) was staged over version 5's f32 file: cut to its own size.
    size = sum(t.numel() * 2 for t in _weights(job, seed=0).values())
    assert size < weights.stat().st_size < size + 4096
    pushes.clean_start()
    assert not pushes.recycle_root.exists()


def test_a_retired_file_a_worker_may_still_read_is_not_written_into(
    daemon, client, job, monkeypatch
):
    """The version whose file was recycled is held or loaded by a worker when the next push
    starts (a load sent just before the file was retired): that push writes a fresh file."""
    pushes = daemon.services.pushes
    recycled = pushes.recycle_root / "job.safetensors"
    for i in range(1, 5):
        client.push_policy("job", _weights(job, seed=i, dtype=torch.bfloat16))
    inode = recycled.stat().st_ino  # version 1's file, retired at version 4's commit
    monkeypatch.setattr(pushes, "in_use", lambda job_id: {1})
    sd = _weights(job, seed=5, dtype=torch.bfloat16)
    weights = Path(client.push_policy("job", sd).policy.path) / "model.safetensors"
    assert weights.stat().st_ino != inode and _same(load_file(str(weights)), sd)
    assert recycled.stat().st_ino != inode  # v2's file now; v1's file was left to its reader


def test_a_push_records_its_progress_while_its_stream_still_runs(
    daemon, client, job, store, monkeypatch
):
    """Every `_CHECKPOINT_BYTES` the staged bytes are synced and recorded, beside the stream:
    a daemon killed mid-push resumes from there. The record never claims more than arrived."""
    import tltd.services.push as push_module

    monkeypatch.setattr(push_module, "_CHECKPOINT_BYTES", 8 << 10)
    seen: list[int] = []

    def recorded() -> int:
        rows = [r for r in store.pushes.list() if r[:2] == ("job", "mid")]
        return sum(rows[0][3].values()) if rows else 0

    def progress(p) -> None:
        if p.bytes_done >= p.bytes_total // 2 and not seen:
            deadline = time.monotonic() + 30
            while (got := recorded()) < 8 << 10:
                assert time.monotonic() < deadline, "no progress recorded mid-stream"
                time.sleep(0.02)
            seen.append(got)
            assert got <= p.bytes_done

    sd = _weights(job, seed=1)
    got = client.push_policy("job", sd, update_id="mid", chunk_bytes=4 << 10, progress=progress)
    assert seen and got.policy.version == 1 and _same(_stored(client, 1), sd)
    assert recorded() == 0  # committed: the record of the unfinished push is gone


def test_an_unfinished_push_resumes_after_a_daemon_restart(sqlite_store, tmp_path, policy):
    """The staging file and the push's record survive a restart: the same update id resumes
    where the first daemon's record says and commits the exact weights."""
    from itertools import islice

    from tests.api.support import DaemonThread, make_settings, seed_devices

    seed_devices(sqlite_store)
    settings = make_settings(tmp_path)
    sd = _weights(policy, seed=7, dtype=torch.bfloat16)
    w = Weights(sd)
    header = header_pb("job", "across", w, "", None)
    first = DaemonThread(settings, sqlite_store).start()
    try:
        with first.client() as c:
            c.create_job(str(policy), job_id="job")
            messages = push_messages(header, w, {}, chunk_bytes=4096, commit=False)
            status = _stream(c, islice(messages, 1 + 5)).status  # the header, 5 chunks
            held = status.bytes_received
            assert 0 < held < sum(t.numel() * 2 for t in sd.values())
    finally:
        first.stop()
    assert [r[:2] for r in sqlite_store.pushes.list()] == [("job", "across")]

    second = DaemonThread(settings, sqlite_store)
    second.services.pushes.clean_start()  # as the daemon does at start
    second.start()
    try:
        with second.client() as c:
            assert c.get_push("job", "across").bytes_received == held
            seen = []
            got = c.push_policy("job", sd, update_id="across", progress=seen.append)
            total = sum(t.numel() * 2 for t in sd.values())
            assert seen[-1].wire_bytes == total - held  # only the rest was sent
            assert got.policy.version == 1 and _same(_stored(c, 1), sd)
    finally:
        second.stop()
    assert sqlite_store.pushes.list() == []


def test_a_restart_drops_recorded_pushes_whose_file_is_gone(sqlite_store, tmp_path, policy):
    from tests.api.support import DaemonThread, make_settings, seed_devices

    seed_devices(sqlite_store)
    settings = make_settings(tmp_path)
    d = DaemonThread(settings, sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(policy), job_id="job")
            w = Weights(_weights(policy, seed=8))
            header = header_pb("job", "lost", w, "", None)
            _stream(c, push_messages(header, w, {}, chunk_bytes=4096, commit=False))
    finally:
        d.stop()
    from tltd.services.push import PushService

    pushes = PushService(sqlite_store, settings, d.services.policy)  # the next start's
    shutil.rmtree(pushes.staging_root / "job" / "lost")
    pushes.clean_start()
    assert sqlite_store.pushes.list() == [] and not pushes._pushes
