"""Pushed weights on the daemon's disk: a safetensors file laid out from the push's header and
filled chunk by chunk at its offsets, and the tensors of a held version read back for deltas.

The file's header is written first and the file sized to its final length, so each chunk goes
straight to its place (one `pwrite`): the daemon never holds more than a chunk of a push in
memory, and the finished file is what the workers load, unchanged.

A push may be staged over the weights file of a retired version (`reuse`): writing into pages
the page cache holds already costs a small fraction of the CPU of writing into fresh ones
(which the kernel must allocate and zero first), the main cost of receiving a push."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

from tltd.domain import TensorSpec
from tltd.services.checkpoints import read_safetensors_header

# Bytes per element of the dtypes a policy's weights may have (the engine casts them).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
WEIGHTS_FILE = "model.safetensors"


def tensor_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPE_BYTES[spec.dtype]


class StagedTensors:
    """A safetensors file of `specs` (in their order), created full size and written in place."""

    def __init__(self, path: Path, specs: tuple[TensorSpec, ...], reuse: bool = False) -> None:
        """`reuse`: `path` is an existing file to overwrite (every byte of it is written
        before the push can commit; its old bytes are never read)."""
        self.path = path
        self.specs = {s.name: s for s in specs}
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        self._start: dict[str, int] = {}
        end = 0
        for s in specs:
            n = tensor_bytes(s)
            header[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [end, end + n],
            }
            self._start[s.name] = end
            end += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
        self._data_start = 8 + len(raw)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if reuse else os.O_TRUNC), 0o644)
        os.pwrite(self._fd, len(raw).to_bytes(8, "little") + raw, 0)
        if reuse and os.fstat(self._fd).st_size > self._data_start + end:
            os.ftruncate(self._fd, self._data_start + end)
        try:  # the blocks reserved now: no allocation per chunk, and a full disk fails here
            os.posix_fallocate(self._fd, 0, self._data_start + end)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                os.close(self._fd)
                raise
            os.ftruncate(self._fd, self._data_start + end)  # sparse until written

    def write(self, name: str, offset: int, data: bytes | memoryview) -> None:
        """Bytes of tensor `name` from `offset` (checked by the caller)."""
        pos = self._data_start + self._start[name] + offset
        view = memoryview(data)
        while view:  # pwrite may write less than asked
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def sync(self) -> None:
        """The bytes written so far are on the disk (ValueError once closed)."""
        if self._fd < 0:
            raise ValueError("closed")
        os.fdatasync(self._fd)

    def finish(self) -> None:
        """Flush to the disk and close: the file is then what a version's path holds."""
        os.fsync(self._fd)
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HeldTensors:
    """Read access to the tensors of a checkpoint directory the daemon holds (a delta's base),
    by name and byte range, without loading them."""

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        self._fds: list[int] = []
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir} (its weights were deleted?)")
        try:
            for path in files:
                header = read_safetensors_header(path)
                with path.open("rb") as f:
                    data_start = 8 + int.from_bytes(f.read(8), "little")
                fd = os.open(path, os.O_RDONLY)
                self._fds.append(fd)
                for name, t in header.items():
                    start = data_start + t["data_offsets"][0]
                    self._where[name] = (fd, start, t["dtype"], tuple(t["shape"]))
        except BaseException:
            self.close()
            raise

    def spec(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(dtype, shape) of tensor `name`, None when the directory has no such tensor."""
        w = self._where.get(name)
        return None if w is None else (w[2], w[3])

    def read(self, name: str, offset: int, length: int) -> bytes:
        fd, start, _, _ = self._where[name]
        out = os.pread(fd, length, start + offset)
        if len(out) != length:
            raise OSError(f"{name}: short read of a held version's weights")
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
