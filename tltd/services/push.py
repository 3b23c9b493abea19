"""Policy weights pushed in-band: chunked, checksummed, resumable, verified, recorded atomically.

A push (job id + caller-chosen update id) is announced by a header listing its tensors, checked
against the job's architecture before any byte is taken. Its chunks are checked (CRC-32C of the
tensor's new bytes; a delta chunk is zstd(new XOR base) over a version the daemon holds) and
written straight into a staging safetensors file (`tltd.staging`). A broken stream leaves what
arrived verified; a new stream with the same update id sends the rest (`status` says what that
is). Only a commit with every byte in makes a version: the staged directory is checked as an
UpdatePolicy checkpoint is, moved under the daemon's policies directory and recorded; workers
then load it like any checkpoint. Pushes left without a stream for `push_idle_seconds` are
dropped with their files, and a restart drops every unfinished one.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c
import numpy as np
import zstandard

from tltd.domain import JobStatus, PolicyVersion, PushHeader, PushStatus, TensorChunk
from tltd.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from tltd.services.checkpoints import check_policy_checkpoint, check_policy_tensors
from tltd.services.validation import MAX_REASON, check_id, check_text
from tltd.staging import DTYPE_BYTES, WEIGHTS_FILE, HeldTensors, StagedTensors, tensor_bytes

if TYPE_CHECKING:
    from tltd.services.policy import PolicyService
    from tltd.settings import Settings
    from tltd.store import Store

log = logging.getLogger(__name__)

_MAX_TENSORS = 100_000
_MAX_NAME = 1024
_MAX_DIM = 1 << 40
# Besides weights, a version's directory holds the job model's small files (config.json, the
# tokenizer): the workers and the checks read config.json from it.
_MAX_SIDE_FILE = 64 << 20


@dataclass
class _Push:
    header: PushHeader
    staging: StagedTensors
    sizes: dict[str, int]
    received: dict[str, int]
    base: HeldTensors | None
    attached: bool = False  # a stream is sending into it
    touched: float = field(default_factory=time.monotonic)

    def status(self, version: int = 0) -> PushStatus:
        h = self.header
        rows = tuple((s.name, self.received[s.name], self.sizes[s.name]) for s in h.tensors)
        return PushStatus(h.job_id, h.update_id, rows, version)

    def drop(self) -> None:
        self.staging.close()
        if self.base is not None:
            self.base.close()
        shutil.rmtree(self.staging.path.parent, ignore_errors=True)


class PushService:
    def __init__(self, store: Store, settings: Settings, policy: PolicyService) -> None:
        self.store = store
        self.policy = policy
        data = Path(settings.data_dir).resolve()  # versions record absolute paths
        self.staging_root = data / "push-staging"
        self.versions_root = data / "policies"
        self.idle_seconds = settings.push_idle_seconds
        self.keep_versions = settings.push_keep_versions
        self._lock = threading.Lock()
        self._pushes: dict[tuple[str, str], _Push] = {}

    # ---- the stream -------------------------------------------------------------------------

    async def receive(self, parts: AsyncIterator[PushHeader | TensorChunk | bool]):
        """Run one stream of a push: its header, chunks, then maybe a commit (True). Returns
        (status, version or None). A stream that breaks leaves the verified bytes for the next
        stream of the same update id."""
        first = await anext(parts, None)
        if not isinstance(first, PushHeader):
            raise InvalidArgument("a push stream must start with its header", field="header")
        attaching = asyncio.ensure_future(asyncio.to_thread(self.attach, first))
        try:
            push = await asyncio.shield(attaching)
        except asyncio.CancelledError:
            # The stream broke while the thread attached it: detach once that is done, or
            # the push would look sent-into forever (and refuse its resumption).
            attaching.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else self.detach(f.result())
            )
            raise
        # One chunk is written (in a thread) while the next is received: the stream never
        # waits for the disk, and a push's chunks are still written one after another.
        writing: asyncio.Future | None = None
        try:
            async for part in parts:
                if isinstance(part, TensorChunk):
                    if writing is not None:
                        await writing
                    writing = asyncio.ensure_future(asyncio.to_thread(self.apply, push, part))
                elif part is True:
                    if writing is not None:
                        await writing
                    version = await asyncio.to_thread(self.commit, push)
                    return push.status(version.version), version
                else:
                    raise InvalidArgument("only the first message is a header", field="header")
            if writing is not None:
                await writing
            return push.status(), None
        finally:
            if writing is not None and not writing.done():  # the stream broke meanwhile
                writing.add_done_callback(
                    lambda f: (f.cancelled() or f.exception(), self.detach(push))
                )
            else:
                self.detach(push)

    def attach(self, header: PushHeader) -> _Push:
        """The push `header` starts or resumes, checked, with this stream attached."""
        self._check_header(header)
        key = (header.job_id, header.update_id)
        with self._lock:
            push = self._pushes.get(key)
            if push is not None:
                if push.attached:
                    raise Aborted(
                        f"push {header.update_id} is being sent by another stream",
                        field="header.update_id",
                    )
                if push.header.tensors != header.tensors:
                    raise InvalidArgument(
                        f"differ from those push {header.update_id} began with: resume with "
                        "the same header, or push under another update_id",
                        field="header.tensors",
                    )
                if push.header.base_version != header.base_version:
                    raise InvalidArgument(
                        f"differs from push {header.update_id}'s {push.header.base_version}",
                        field="header.base_version",
                    )
                push.attached, push.touched = True, time.monotonic()
                return push
        done = self._recorded(header.job_id, header.update_id)
        if done is not None:
            raise AlreadyExists(
                f"push {header.update_id} is already policy version {done.version}",
                field="header.update_id",
            )
        push = self._begin(header)
        with self._lock:
            if key in self._pushes:  # another stream began it meanwhile
                push.drop()
                raise Aborted(
                    f"push {header.update_id} is being sent by another stream",
                    field="header.update_id",
                )
            self._pushes[key] = push
        return push

    def detach(self, push: _Push) -> None:
        with self._lock:
            push.attached, push.touched = False, time.monotonic()

    def apply(self, push: _Push, chunk: TensorChunk) -> None:
        """Check one chunk and write its bytes in place; InvalidArgument naming the field of
        the first problem (nothing of that chunk is kept then)."""
        size = push.sizes.get(chunk.name)
        if size is None:
            raise InvalidArgument(
                f"{chunk.name!r} is not a tensor of push {push.header.update_id}",
                field="chunk.name",
            )
        have = push.received[chunk.name]
        if chunk.offset > have:
            raise InvalidArgument(
                f"{chunk.offset} leaves a gap in {chunk.name}: the daemon holds its first "
                f"{have} bytes, send from there",
                field="chunk.offset",
            )
        if chunk.length <= 0 or chunk.offset + chunk.length > size:
            raise InvalidArgument(
                f"{chunk.length} bytes from {chunk.offset} do not fit {chunk.name}'s {size}",
                field="chunk.length",
            )
        data = self._new_bytes(push, chunk)
        got = crc32c.crc32c(data)
        if got != chunk.crc32c:
            raise InvalidArgument(
                f"bytes {chunk.offset}-{chunk.offset + chunk.length} of {chunk.name} have "
                f"CRC-32C {got:#010x}, the chunk says {chunk.crc32c:#010x} (corrupted in transit?)",
                field="chunk.crc32c",
            )
        push.staging.write(chunk.name, chunk.offset, data)
        push.received[chunk.name] = max(have, chunk.offset + chunk.length)
        push.touched = time.monotonic()

    def store_tensor(self, push: _Push, name: str, data) -> None:
        """A whole tensor that arrived by another transport than chunks (a broadcast)."""
        if len(data) != push.sizes[name]:
            raise ValueError(f"{name}: {len(data)} bytes, the header says {push.sizes[name]}")
        push.staging.write(name, 0, data)
        push.received[name] = push.sizes[name]
        push.touched = time.monotonic()

    def commit(self, push: _Push) -> PolicyVersion:
        """Record the push as the job's next version once every byte is in and the staged
        checkpoint passes UpdatePolicy's checks; nothing of it is visible before."""
        h = push.header
        missing = [s.name for s in h.tensors if push.received[s.name] < push.sizes[s.name]]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise FailedPrecondition(
                f"{len(missing)} tensors are incomplete: {', '.join(missing[:5])}{more}; "
                "send their remaining chunks (GetPush says which bytes the daemon holds)",
                field="commit",
            )
        key = (h.job_id, h.update_id)
        staged, final = push.staging.path.parent, self.versions_root / h.job_id / h.update_id
        try:
            # Whole and checked, or gone: a complete push that fails here cannot be mended by
            # resuming it.
            job = self.store.get_job(h.job_id)
            push.staging.finish()
            _copy_side_files(Path(job.model_path), staged)
            check_policy_checkpoint(staged, Path(job.model_path), "commit")
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a crash before its record
            staged.rename(final)
            version = self.policy.record(h.job_id, "push", str(final), h.note)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            with self._lock:
                self._pushes.pop(key, None)
            push.drop()
            raise
        with self._lock:
            self._pushes.pop(key, None)
        if push.base is not None:
            push.base.close()
        self._retire_old_versions(h.job_id, version.version)
        log.info(
            "policy pushed",
            extra={"job_id": h.job_id, "version": version.version, "update_id": h.update_id},
        )
        return version

    # ---- reads and housekeeping -------------------------------------------------------------

    def status(self, job_id: str, update_id: str) -> PushStatus:
        """What the daemon holds of a push; NotFound when nothing (start from the beginning)."""
        check_id(job_id, "job_id")
        check_id(update_id, "update_id")
        with self._lock:
            push = self._pushes.get((job_id, update_id))
            if push is not None:
                return push.status()
        done = self._recorded(job_id, update_id)
        if done is None:
            raise NotFound(f"no push {update_id} of job {job_id}", field="update_id")
        return PushStatus(job_id, update_id, (), done.version)

    def collect(self, now: float | None = None) -> list[str]:
        """Drop pushes no stream has sent into for `push_idle_seconds` (an abandoned push
        leaves no files). Returns their update ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                k
                for k, p in self._pushes.items()
                if not p.attached and now - p.touched > self.idle_seconds
            ]
            dropped = [self._pushes.pop(k) for k in stale]
        for p in dropped:
            p.drop()
            log.info("abandoned push dropped", extra={"job_id": p.header.job_id})
        return [p.header.update_id for p in dropped]

    def clean_start(self) -> None:
        """At start: pushes of a previous run cannot be resumed (their progress was in its
        memory), so their staging files go."""
        shutil.rmtree(self.staging_root, ignore_errors=True)

    # ---- helpers ----------------------------------------------------------------------------

    def _check_header(self, h: PushHeader) -> None:
        check_id(h.job_id, "header.job_id")
        check_id(h.update_id, "header.update_id")
        check_text(h.note, "header.note", MAX_REASON)
        if not h.tensors:
            raise InvalidArgument("a push needs at least one tensor", field="header.tensors")
        if len(h.tensors) > _MAX_TENSORS:
            raise InvalidArgument(f"more than {_MAX_TENSORS} tensors", field="header.tensors")
        seen: set[str] = set()
        for i, t in enumerate(h.tensors):
            f = f"header.tensors[{i}]"
            if not t.name or len(t.name) > _MAX_NAME or "\x00" in t.name:
                raise InvalidArgument(f"a name of 1-{_MAX_NAME} characters", field=f"{f}.name")
            if t.name in seen:
                raise InvalidArgument(f"{t.name} appears twice", field=f"{f}.name")
            seen.add(t.name)
            if t.dtype not in DTYPE_BYTES:
                raise InvalidArgument(
                    f"{t.name} has dtype {t.dtype!r}, not one of {sorted(DTYPE_BYTES)}",
                    field=f"{f}.dtype",
                )
            if any(not 0 <= n < _MAX_DIM for n in t.shape):
                raise InvalidArgument(
                    f"{t.name} has shape {t.shape}: dimensions are 0 to {_MAX_DIM - 1}",
                    field=f"{f}.shape",
                )
        job = self.store.get_job(h.job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {h.job_id} is {job.status.value}", field="job_id")
        announced = {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in h.tensors}
        check_policy_tensors(
            announced, Path(job.model_path), "the pushed tensors", "header.tensors"
        )

    def _begin(self, h: PushHeader) -> _Push:
        path = self.staging_root / h.job_id / h.update_id / WEIGHTS_FILE
        shutil.rmtree(path.parent, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        need = sum(tensor_bytes(t) for t in h.tensors)
        free = shutil.disk_usage(path.parent).free
        if need > free:
            shutil.rmtree(path.parent, ignore_errors=True)
            raise ResourceExhausted(
                f"the push needs {need} bytes, the daemon's disk has {free} free",
                field="header.tensors",
            )
        base = self._base(h) if h.base_version is not None else None
        staging = StagedTensors(path, h.tensors)
        sizes = {t.name: tensor_bytes(t) for t in h.tensors}
        return _Push(h, staging, sizes, dict.fromkeys(sizes, 0), base, attached=True)

    def _base(self, h: PushHeader) -> HeldTensors:
        """The tensors of the version a delta push applies to, each checked to match."""
        try:
            v = self.store.get_policy_version(h.job_id, h.base_version)
        except NotFound as exc:
            raise NotFound(str(exc), field="header.base_version") from None
        try:
            base = HeldTensors(Path(v.path))
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(
                f"version {v.version}'s weights cannot be read for a delta ({exc}): push in full",
                field="header.base_version",
            ) from exc
        for t in h.tensors:
            if base.spec(t.name) != (t.dtype, t.shape):
                base.close()
                raise InvalidArgument(
                    f"version {v.version} holds {t.name} as {base.spec(t.name)}, the push "
                    f"{(t.dtype, t.shape)}: a delta needs the same dtype and shape",
                    field="header.base_version",
                )
        return base

    def _new_bytes(self, push: _Push, chunk: TensorChunk) -> bytes | np.ndarray:
        if not chunk.delta:
            if len(chunk.data) != chunk.length:
                raise InvalidArgument(
                    f"{len(chunk.data)} bytes where the chunk says {chunk.length}",
                    field="chunk.data",
                )
            return chunk.data
        if push.base is None:
            raise InvalidArgument(
                "a delta chunk in a push without header.base_version", field="chunk.delta"
            )
        try:
            xor = zstandard.ZstdDecompressor().decompress(chunk.data, max_output_size=chunk.length)
        except zstandard.ZstdError as exc:
            raise InvalidArgument(f"not a zstd frame: {exc}", field="chunk.data") from exc
        if len(xor) != chunk.length:
            raise InvalidArgument(
                f"decompresses to {len(xor)} bytes where the chunk says {chunk.length}",
                field="chunk.data",
            )
        old = push.base.read(chunk.name, chunk.offset, chunk.length)
        return np.bitwise_xor(np.frombuffer(xor, np.uint8), np.frombuffer(old, np.uint8))

    def _retire_old_versions(self, job_id: str, newest: int) -> list[int]:
        """Delete the weights of the job's pushed versions beyond the newest `keep_versions`
        (never a version a push in progress applies a delta to). Their rows stay: a request
        still on such a version fails to load it, with the reason. Returns their numbers."""
        if self.keep_versions <= 0:
            return []
        with self._lock:
            bases = {p.header.base_version for (j, _), p in self._pushes.items() if j == job_id}
        retired = []
        for v in self.store.list_policy_versions(job_id):
            path = Path(v.path)
            if (
                v.source == "push"
                and v.version <= newest - self.keep_versions
                and v.version not in bases
                and path.parent.parent == self.versions_root
                and path.is_dir()
            ):
                shutil.rmtree(path, ignore_errors=True)
                retired.append(v.version)
        if retired:
            log.info("pushed weights retired", extra={"job_id": job_id, "versions": retired})
        return retired

    def _recorded(self, job_id: str, update_id: str) -> PolicyVersion | None:
        """The version a committed push became (its directory is named after the update id)."""
        path = str(self.versions_root / job_id / update_id)
        try:
            versions = self.store.list_policy_versions(job_id)
        except NotFound:
            return None
        return next((v for v in versions if v.source == "push" and v.path == path), None)


def _copy_side_files(model_dir: Path, dest: Path) -> None:
    """The job model's config.json, tokenizer and other small files, beside the pushed weights
    (never its weights or their index, which name other files)."""
    for src in model_dir.iterdir():
        if (
            src.is_file()
            and ".safetensors" not in src.name
            and not src.name.endswith((".bin", ".pt", ".pth"))
            and src.stat().st_size <= _MAX_SIDE_FILE
        ):
            shutil.copyfile(src, dest / src.name)
