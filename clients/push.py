"""Pushing policy weights to a daemon over gRPC (PushPolicy): chunks with CRC-32C, resumed after
a broken stream, optionally as a delta (zstd of new XOR base) over a version the daemon holds.

Weights come as a state dict of torch tensors (HF names) or as safetensors files (a file or a
directory of them, read through mmap): the client never copies the whole model either."""

from __future__ import annotations

import json
import mmap
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import zstandard

from tltd.v1 import policy_pb2

DEFAULT_CHUNK_BYTES = 4 << 20
# A delta chunk compressed to more than this share of its raw size is sent raw instead.
_DELTA_WORTH = 0.9

_TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


@dataclass
class PushProgress:
    """Passed to a push's `progress` callback after every chunk the daemon was sent."""

    update_id: str
    bytes_done: int  # bytes of the model the daemon holds or was sent in this push
    bytes_total: int
    wire_bytes: int  # chunk payload bytes sent by this call so far (smaller for deltas)


class Weights:
    """Named tensors as raw little-endian bytes: (dtype, shape) and byte views without copies."""

    def __init__(self, source: Mapping[str, Any] | str | Path) -> None:
        self._maps: list[mmap.mmap] = []
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._bytes: dict[str, memoryview] = {}
        if isinstance(source, (str, Path)):
            self._open_files(Path(source))
        else:
            for name, t in source.items():
                self._add_tensor(name, t)

    def _add_tensor(self, name: str, t: Any) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: a torch.Tensor is required, got {type(t).__name__}")
        dtype = _TORCH_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} is not a floating-point weight type")
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        self.specs[name] = (dtype, tuple(t.shape))
        self._bytes[name] = memoryview(flat.view(torch.uint8).numpy())

    def _open_files(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        for f in files:
            with f.open("rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(m)
            n = int.from_bytes(m[:8], "little")
            header = json.loads(m[8 : 8 + n])
            view = memoryview(m)
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                begin, end = t["data_offsets"]
                self.specs[name] = (t["dtype"], tuple(t["shape"]))
                self._bytes[name] = view[8 + n + begin : 8 + n + end]

    def data(self, name: str) -> memoryview:
        return self._bytes[name]

    def close(self) -> None:
        self._bytes.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held by the caller: the GC closes it
                pass
        self._maps = []


def header_pb(
    job_id: str, update_id: str, weights: Weights, note: str, base_version: int | None
) -> policy_pb2.PushHeader:
    tensors = [
        policy_pb2.TensorSpec(name=name, dtype=dtype, shape=shape)
        for name, (dtype, shape) in weights.specs.items()
    ]
    return policy_pb2.PushHeader(
        job_id=job_id, update_id=update_id, tensors=tensors, note=note, base_version=base_version
    )


@dataclass(frozen=True)
class _Chunk:
    """One chunk before it is a message: `data` is a view of the weights (raw) or the zstd
    frame of new XOR base (delta)."""

    name: str
    offset: int
    length: int
    data: bytes | memoryview
    delta: bool
    crc32c: int

    def message(self) -> policy_pb2.TensorChunk:
        return policy_pb2.TensorChunk(
            name=self.name,
            offset=self.offset,
            length=self.length,
            data=bytes(self.data),
            delta=self.delta,
            crc32c=self.crc32c,
        )

    def request_bytes(self) -> bytes:
        """The serialized PushPolicyRequest{chunk: ...}, built with one copy of the data (the
        protobuf runtime would copy it into the message, into the request, and out again).
        Protobuf wire format: the fields in any order, the data last so it is appended."""
        name = self.name.encode()
        head = b"".join(
            (
                b"\x0a" + _varint(len(name)) + name,  # 1: name
                b"\x10" + _varint(self.offset),  # 2: offset
                b"\x18" + _varint(self.length),  # 3: length
                b"\x28\x01" if self.delta else b"",  # 5: delta
                b"\x30" + _varint(self.crc32c),  # 6: crc32c
                b"\x22" + _varint(len(self.data)),  # 4: data (its bytes follow)
            )
        )
        # PushPolicyRequest field 2 (chunk), length-delimited.
        return b"".join((b"\x12", _varint(len(head) + len(self.data)), head, self.data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _chunk(name: str, new: memoryview, old: memoryview | None, offset: int) -> _Chunk:
    """One chunk: raw bytes, or zstd(new XOR old) when a base is given and that is worth it;
    the checksum is of the new bytes either way."""
    crc = crc32c.crc32c(new)
    if old is not None:
        xor = np.bitwise_xor(np.frombuffer(new, np.uint8), np.frombuffer(old, np.uint8))
        packed = zstandard.ZstdCompressor(level=1).compress(xor)
        if len(packed) < _DELTA_WORTH * len(new):
            return _Chunk(name, offset, len(new), packed, True, crc)
    return _Chunk(name, offset, len(new), new, False, crc)


def push_messages(
    header: policy_pb2.PushHeader,
    weights: Weights,
    have: Mapping[str, int],
    *,
    base: Weights | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_chunk: Callable[[int, int], None] | None = None,
    commit: bool = True,
    serialized: bool = False,
) -> Iterator[policy_pb2.PushPolicyRequest | bytes]:
    """The messages of one stream: the header, every chunk the daemon lacks (`have`: bytes it
    holds per tensor), the commit. Chunks are prepared two ahead in a thread pool (checksum,
    XOR, compression and the copy into the message release the GIL) while gRPC sends.
    `serialized`: every message as its serialized bytes (for a stub that sends bytes as they
    are; chunks are then built without the protobuf runtime's copies). `on_chunk(length,
    wire)` after each chunk: its bytes of the tensor, its payload bytes on the wire."""

    def out(m: policy_pb2.PushPolicyRequest) -> policy_pb2.PushPolicyRequest | bytes:
        return m.SerializeToString() if serialized else m

    yield out(policy_pb2.PushPolicyRequest(header=header))
    todo = [
        (name, offset)
        for name in weights.specs
        for offset in range(have.get(name, 0), len(weights.data(name)), chunk_bytes)
    ]

    def make(item: tuple[str, int]) -> tuple[_Chunk, policy_pb2.PushPolicyRequest | bytes]:
        name, offset = item
        new = weights.data(name)[offset : offset + chunk_bytes]
        old = base.data(name)[offset : offset + chunk_bytes] if base is not None else None
        c = _chunk(name, new, old, offset)
        if serialized:
            return c, c.request_bytes()
        return c, policy_pb2.PushPolicyRequest(chunk=c.message())

    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = [pool.submit(make, item) for item in todo[:2]]
        for i in range(len(todo)):
            chunk, message = pending.pop(0).result()
            if i + 2 < len(todo):
                pending.append(pool.submit(make, todo[i + 2]))
            yield message
            if on_chunk is not None:
                on_chunk(chunk.length, len(chunk.data))
    if commit:
        yield out(policy_pb2.PushPolicyRequest(commit=True))


def open_push(
    weights: Mapping[str, Any] | str | Path,
    base_version: int | None,
    base_weights: Mapping[str, Any] | str | Path | None,
) -> tuple[Weights, Weights | None]:
    """A push's new weights and, for a delta push, the base version's (both or neither)."""
    if (base_weights is None) != (base_version is None):
        raise ValueError("base_version and base_weights go together (a delta needs both)")
    new = Weights(weights)
    base = Weights(base_weights) if base_weights is not None else None
    if base is not None and base.specs != new.specs:
        new.close()
        base.close()
        raise ValueError("base_weights must hold the same tensors, dtypes and shapes")
    return new, base


class ProgressCounter:
    """Counts what a push sent (`__call__` after every chunk) and reports it to `progress`."""

    def __init__(
        self,
        update_id: str,
        done: int,
        total: int,
        progress: Callable[[PushProgress], None] | None,
    ) -> None:
        self.update_id, self.done, self.total, self.wire = update_id, done, total, 0
        self.progress = progress

    def __call__(self, length: int, payload: int) -> None:
        self.done, self.wire = self.done + length, self.wire + payload
        if self.progress is not None:
            self.progress(PushProgress(self.update_id, self.done, self.total, self.wire))


def new_update_id() -> str:
    return f"push-{uuid.uuid4().hex[:16]}"
