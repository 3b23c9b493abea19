"""Policy weights pushed in-band: chunked, checksummed, resumable, verified, recorded atomically.

A push (job id + caller-chosen update id) is announced by a header listing its tensors, checked
against the job's architecture before any byte is taken. Its chunks are checked (CRC-32C of the
tensor's new bytes; a delta chunk is zstd(new XOR base) over a version the daemon holds) and
written straight into a staging safetensors file (`tltd.staging`). A broken stream leaves what
arrived verified; a new stream with the same update id sends the rest (`status` says what that
is). Only a commit with every byte in makes a version: the staged directory is checked as an
UpdatePolicy checkpoint is, moved under the daemon's policies directory and recorded; workers
then load it like any checkpoint. Pushes left without a stream for `push_idle_seconds` are
dropped with their files.

An unfinished push is recorded in the database (its header and how many bytes of each tensor
its staging file holds, synced to disk first): at every stream's end and every
`_CHECKPOINT_BYTES` received. A restarted daemon takes up the pushes its node recorded, so the
same update id resumes from what the record says (what came after the last record is sent
again); a push whose staging file is gone or whose job ended is dropped then.

The weights file of a pushed version retired beyond `push_keep_versions` is kept (one per job)
and the job's next push is staged over it (`tltd.staging`): in steady state a push writes into
pages the page cache holds already instead of fresh ones. A file is recycled only while no
worker holds or loads its version (the supervisor says which do).
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
import zstandard

from tltd.domain import (
    JobStatus,
    PolicyVersion,
    PushHeader,
    PushStatus,
    TensorChunk,
    TensorSpec,
)
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
    import numpy as np

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
# An unfinished push's progress is synced and recorded at least this often (bytes received).
_CHECKPOINT_BYTES = 256 << 20


@dataclass
class _Push:
    header: PushHeader
    staging: StagedTensors
    sizes: dict[str, int]
    received: dict[str, int]
    base: HeldTensors | None
    attached: bool = False  # a stream is sending into it
    touched: float = field(default_factory=time.monotonic)
    unrecorded: int = 0  # bytes received since its progress was last recorded
    recording: threading.Lock = field(default_factory=threading.Lock)  # a record under way

    def status(self, version: int = 0) -> PushStatus:
        h = self.header
        rows = tuple((s.name, self.received[s.name], self.sizes[s.name]) for s in h.tensors)
        return PushStatus(h.job_id, h.update_id, rows, version)

    def drop(self) -> None:
        self.staging.close()
        if self.base is not None:
            self.base.close()
        shutil.rmtree(self.staging.path.parent, ignore_errors=True)


def check_header_fields(h: PushHeader) -> None:
    """A push header's own fields: ids, note, and every tensor's name, dtype and shape."""
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


class PushService:
    def __init__(self, store: Store, settings: Settings, policy: PolicyService) -> None:
        self.store = store
        self.policy = policy
        root = settings.pushes_root  # versions record absolute paths
        # On a shared directory each node stages and recycles in its own folder.
        node = (settings.resolved_node_id,) if settings.shared_dir else ()
        self.staging_root = root.joinpath("push-staging", *node)
        self.recycle_root = root.joinpath("push-recycle", *node)  # a retired file per job
        self.versions_root = root / "policies"
        # Not on a shared directory: another node's worker may be reading a retired file.
        self.recycling = not settings.shared_dir
        self.idle_seconds = settings.push_idle_seconds
        self.keep_versions = settings.push_keep_versions
        self._lock = threading.Lock()
        self._pushes: dict[tuple[str, str], _Push] = {}
        self._recycled: dict[str, int] = {}  # job id -> the version its recycled file was

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
            await asyncio.to_thread(self.record_progress, push)
            return push.status(), None
        finally:
            if writing is not None and not writing.done():  # the stream broke meanwhile
                writing.add_done_callback(
                    lambda f: (f.cancelled() or f.exception(), self._detach_recorded(push))
                )
            else:
                self._detach_recorded(push)

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
        self.store.pushes.save(header.job_id, header.update_id, _header_json(header), push.received)
        return push

    def detach(self, push: _Push) -> None:
        with self._lock:
            push.attached, push.touched = False, time.monotonic()

    def _detach_recorded(self, push: _Push) -> None:
        """Detach, and record the progress of a push still unfinished (in a thread: the
        stream may be gone already)."""
        self.detach(push)
        if push.unrecorded:
            asyncio.get_running_loop().run_in_executor(None, self.record_progress, push)

    def record_progress(self, push: _Push, wait: bool = True) -> None:
        """Sync the staging file and record what it holds (never more than is on disk: the
        counts are read before the sync). A push committed or dropped meanwhile is left: a
        commit or a drop holds `push.recording`, so no record lands after it forgot the push.
        `wait=False`: skip it when another record is under way."""
        if not push.recording.acquire(blocking=wait):
            return
        try:
            h = push.header
            received = dict(push.received)
            push.unrecorded = 0
            try:
                push.staging.sync()
            except (OSError, ValueError):
                return  # closed: committed or dropped
            with self._lock:
                if self._pushes.get((h.job_id, h.update_id)) is not push:
                    return
            self.store.pushes.save(h.job_id, h.update_id, _header_json(h), received)
        finally:
            push.recording.release()

    def _record_in_background(self, push: _Push) -> None:
        try:
            self.record_progress(push, wait=False)
        except Exception:  # noqa: BLE001 - a thread of its own; the next record tries again
            log.exception("cannot record a push's progress", extra={"job_id": push.header.job_id})

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
        push.unrecorded += chunk.length
        if push.unrecorded >= _CHECKPOINT_BYTES and not push.recording.locked():
            # Synced and recorded beside the stream: the chunks keep coming while the disk
            # writes back (a sync of fresh blocks takes about as long as their transfer).
            threading.Thread(
                target=self._record_in_background, args=(push,), name="push-record", daemon=True
            ).start()

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
        with push.recording:  # a progress record under way lands first; none after
            return self._commit(push)

    def _commit(self, push: _Push) -> PolicyVersion:
        h = push.header
        key = (h.job_id, h.update_id)
        staged, final = push.staging.path.parent, self.versions_root / h.job_id / h.update_id
        try:
            # Whole and checked, or gone: a complete push that fails here cannot be mended by
            # resuming it.
            job = self.store.jobs.get(h.job_id)
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
            self._forget(h)
            raise
        with self._lock:
            self._pushes.pop(key, None)
        self._forget(h)
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
            with p.recording:  # no progress record lands after the push is forgotten
                p.drop()
                self._forget(p.header)
            log.info("abandoned push dropped", extra={"job_id": p.header.job_id})
        return [p.header.update_id for p in dropped]

    def clean_start(self) -> None:
        """At start: take up the unfinished pushes this node recorded, each resumable from
        what its record says; staging files without a record go (and the retired files kept
        for reuse)."""
        shutil.rmtree(self.recycle_root, ignore_errors=True)
        kept: set[Path] = set()
        for job_id, update_id, header, received in self.store.pushes.list():
            try:
                push = self._restore(job_id, update_id, header, received)
            except Exception as exc:  # its file, its job or its base is gone: drop it
                log.info(
                    "unfinished push dropped at start",
                    extra={"job_id": job_id, "update_id": update_id, "reason": str(exc)},
                )
                shutil.rmtree(self.staging_root / job_id / update_id, ignore_errors=True)
                self.store.pushes.delete(job_id, update_id)
                continue
            with self._lock:
                self._pushes[job_id, update_id] = push
            kept.add(push.staging.path.parent)
        for job_dir in self.staging_root.iterdir() if self.staging_root.is_dir() else ():
            for d in job_dir.iterdir() if job_dir.is_dir() else (job_dir,):
                if d not in kept:
                    shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink()

    def _restore(self, job_id: str, update_id: str, header: dict, received: dict) -> _Push:
        h = PushHeader(
            job_id,
            update_id,
            tuple(TensorSpec(n, dt, tuple(shape)) for n, dt, shape in header["tensors"]),
            header.get("note", ""),
            header.get("base_version"),
        )
        job = self.store.jobs.get(job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {job_id} is {job.status.value}")
        path = self.staging_root / job_id / update_id / WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is gone")
        sizes = {t.name: tensor_bytes(t) for t in h.tensors}
        if path.stat().st_size < sum(sizes.values()):
            raise ValueError(f"{path} is shorter than the push")
        base = self._base(h) if h.base_version is not None else None
        staging = StagedTensors(path, h.tensors, reuse=True)
        have = {n: min(int(received.get(n, 0)), sizes[n]) for n in sizes}
        log.info("unfinished push taken up", extra={"job_id": job_id, "update_id": update_id})
        return _Push(h, staging, sizes, have, base)

    def _forget(self, h: PushHeader) -> None:
        """The push's record goes (committed, or dropped with its files)."""
        try:
            self.store.pushes.delete(h.job_id, h.update_id)
        except Exception:  # the row is dropped at the next start when its file is gone
            log.warning("push record not deleted", extra={"job_id": h.job_id}, exc_info=True)

    # ---- helpers ----------------------------------------------------------------------------

    def _check_header(self, h: PushHeader) -> None:
        check_header_fields(h)
        job = self.store.jobs.get(h.job_id)
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
        reuse = self._take_recycled(h.job_id, path)
        if reuse:
            need -= path.stat().st_size
        free = shutil.disk_usage(path.parent).free
        if need > free:
            shutil.rmtree(path.parent, ignore_errors=True)
            raise ResourceExhausted(
                f"the push needs {need} bytes, the daemon's disk has {free} free",
                field="header.tensors",
            )
        base = self._base(h) if h.base_version is not None else None
        staging = StagedTensors(path, h.tensors, reuse=reuse)
        sizes = {t.name: tensor_bytes(t) for t in h.tensors}
        return _Push(h, staging, sizes, dict.fromkeys(sizes, 0), base, attached=True)

    def _base(self, h: PushHeader) -> HeldTensors:
        """The tensors of the version a delta push applies to, each checked to match."""
        try:
            v = self.store.policies.get(h.job_id, h.base_version)
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
        import numpy as np  # here: delta pushes only, and it is ~0.2 s of a daemon's start

        return np.bitwise_xor(np.frombuffer(xor, np.uint8), np.frombuffer(old, np.uint8))

    def _retire_old_versions(self, job_id: str, newest: int) -> list[int]:
        """Delete the weights of the job's pushed versions beyond the newest `keep_versions`
        (never a version a push in progress applies a delta to). Their rows stay: a request
        still on such a version fails to load it, with the reason. Returns their numbers."""
        if self.keep_versions <= 0:
            return []
        with self._lock:
            bases = {p.header.base_version for (j, _), p in self._pushes.items() if j == job_id}
        in_use = self.in_use(job_id)
        retired = []
        for v in self.store.policies.list(job_id):
            path = Path(v.path)
            if (
                v.source == "push"
                and v.version <= newest - self.keep_versions
                and v.version not in bases
                and path.parent.parent == self.versions_root
                and path.is_dir()
            ):
                if self.recycling and v.version not in in_use:
                    self._recycle(job_id, v.version, path / WEIGHTS_FILE)
                shutil.rmtree(path, ignore_errors=True)
                retired.append(v.version)
        if retired:
            log.info("pushed weights retired", extra={"job_id": job_id, "versions": retired})
        return retired

    def in_use(self, job_id: str) -> set[int]:
        """The job's policy versions a worker holds or is loading (their files are not
        recycled: a load may be reading one)."""
        supervisor = self.policy.supervisor
        return supervisor.policy_versions_in_use(job_id) if supervisor is not None else set()

    def _recycle(self, job_id: str, version: int, weights: Path) -> None:
        """Keep a retired version's weights file for the job's next push (the newest one)."""
        if not weights.is_file():
            return
        self.recycle_root.mkdir(parents=True, exist_ok=True)
        try:
            weights.replace(self.recycle_root / f"{job_id}.safetensors")
        except OSError:
            return  # another file system, or gone: the push writes a fresh file then
        with self._lock:
            self._recycled[job_id] = version

    def _take_recycled(self, job_id: str, path: Path) -> bool:
        """Move the job's recycled weights file to `path`; False when there is none, or when
        a worker holds or loads the version it was: a load sent just before the file was
        retired may still be reading it, and the push would write into its pages (a worker
        that starts a load later finds no file at the version's path and fails cleanly)."""
        with self._lock:
            version = self._recycled.get(job_id)
        if version is not None and version in self.in_use(job_id):
            return False
        try:
            (self.recycle_root / f"{job_id}.safetensors").replace(path)
        except OSError:
            return False
        with self._lock:
            self._recycled.pop(job_id, None)
        return True

    def _recorded(self, job_id: str, update_id: str) -> PolicyVersion | None:
        """The version a committed push became (its directory is named after the update id)."""
        path = str(self.versions_root / job_id / update_id)
        try:
            versions = self.store.policies.list(job_id)
        except NotFound:
            return None
        return next((v for v in versions if v.source == "push" and v.path == path), None)


def _header_json(h: PushHeader) -> dict:
    return {
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in h.tensors],
        "note": h.note,
        "base_version": h.base_version,
    }


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
