"""Drafter use cases: list, inspect, pin and export learned drafter versions of a job."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.domain import DrafterVersion
from tltd.errors import FailedPrecondition, InvalidArgument
from tltd.services.validation import MAX_PATH, check_id, check_text

if TYPE_CHECKING:
    from tltd.store import Store

EXPORT_FORMATS = ("sglang-eagle",)

log = logging.getLogger(__name__)


class DrafterService:
    def __init__(self, store: Store) -> None:
        self.store = store

    def list(self, job_id: str) -> tuple[list[DrafterVersion], int]:
        """All versions of a job's drafter and the version workers use now (0 = none)."""
        check_id(job_id, "job_id")
        self.store.jobs.get(job_id)  # NotFound for an unknown job, not an empty list
        return self.store.drafters.list(job_id), self.store.drafters.active_version(job_id)

    def get(self, job_id: str, version: int) -> DrafterVersion:
        check_id(job_id, "job_id")
        if version < 1:
            raise InvalidArgument("must be >= 1", field="version")
        return self.store.drafters.get(job_id, version)

    def pin(self, job_id: str, version: int) -> tuple[DrafterVersion | None, int]:
        """Pin a version (0 unpins); returns the pinned drafter (None when unpinned) and the
        version now active."""
        check_id(job_id, "job_id")
        self.store.jobs.get(job_id)
        if version:
            self.store.drafters.get(job_id, version)  # NotFound names the version
        active = self.store.drafters.pin(job_id, version)
        return (self.store.drafters.get(job_id, version) if version else None), active

    def export(
        self, job_id: str, version: int, output_dir: str, fmt: str = ""
    ) -> tuple[str, list[str]]:
        """Write a version as a standalone SGLang EAGLE checkpoint (see
        `tltd_workers.drafter.versions.export_sglang` for the name mapping); returns the output
        directory and the files written. INVALID_ARGUMENT naming output_dir when it is relative
        or the daemon cannot write there; FAILED_PRECONDITION naming version when the version's
        checkpoint or its target policy's files are gone."""
        fmt = fmt or EXPORT_FORMATS[0]
        if fmt not in EXPORT_FORMATS:
            raise InvalidArgument(f"must be one of {', '.join(EXPORT_FORMATS)}", field="format")
        out = _output_dir(output_dir)
        dv = self.get(job_id, version)
        policy = self.store.policies.get(job_id, dv.policy_version)
        needed = [Path(dv.path) / "model.safetensors", Path(dv.path) / "config.json"]
        needed.append(Path(policy.path) / "config.json")
        for f in needed:
            if not f.is_file():
                raise FailedPrecondition(
                    f"drafter version {version} of job {job_id!r} cannot be exported: {f} "
                    "is missing",
                    field="version",
                )
        # Imported here: the drafter package pulls in torch, which the API layer otherwise
        # does not need.
        from safetensors import SafetensorError

        from tltd_workers.drafter.versions import export_sglang

        _check_writable(out)
        try:
            result = export_sglang(dv.path, policy.path, out)
        except OSError as exc:
            # Writing there failed (full disk, a file appearing): the caller's directory.
            if exc.filename and Path(str(exc.filename)).is_relative_to(out):
                raise InvalidArgument(
                    f"{out} cannot be written: {exc}", field="output_dir"
                ) from exc
            raise FailedPrecondition(
                f"drafter version {version} of job {job_id!r} cannot be exported: {exc}",
                field="version",
            ) from exc
        except (ValueError, KeyError, SafetensorError) as exc:
            raise FailedPrecondition(
                f"drafter version {version} of job {job_id!r} cannot be exported: {exc}",
                field="version",
            ) from exc
        for note in result.notes:
            log.warning("drafter export: %s", note, extra={"job_id": job_id, "version": version})
        return str(result.path), sorted(p.name for p in result.path.iterdir())


def _output_dir(output_dir: str) -> Path:
    """The export directory as given: absolute (a relative one would land under the daemon's
    working directory, which the caller neither knows nor controls)."""
    if not output_dir:
        raise InvalidArgument("must not be empty", field="output_dir")
    check_text(output_dir, "output_dir", MAX_PATH)
    out = Path(output_dir)
    if not out.is_absolute():
        raise InvalidArgument(
            f"must be an absolute path on the daemon's node, got {output_dir!r}",
            field="output_dir",
        )
    return out


def _check_writable(out: Path) -> None:
    """InvalidArgument naming output_dir unless the daemon can create files in `out` (created
    with its parents when missing), checked by writing one before the export."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        why = "is not a directory" if out.exists() and not out.is_dir() else "is not writable"
        raise InvalidArgument(f"{out} {why} for the daemon: {exc}", field="output_dir") from exc
