"""The data directory's disk fills while a drafter checkpoint is written: a clear error naming
the checkpoint, the previous checkpoint intact and still the one LATEST points at, and nothing
half-written left behind (it would hold the space the next attempt needs).

The filesystem is a real size-limited tmpfs mounted for the test (needs root and permission
to mount).
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.ci import skip_unless_ci
from tltd_workers.drafter import versions as versions_mod
from tltd_workers.drafter.trainer import TrainerState, latest_checkpoint, load_state, save_state

FS_BYTES = 2 << 20  # room for one checkpoint of the state below (~1.2 MB), not two


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A directory on a real 2 MiB tmpfs (no mount permission: skipped, and failed under CI)."""
    mnt = tmp_path / "data"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _state(step: int, fill: float) -> TrainerState:
    params = {"fc.weight": torch.full((256, 512), fill)}  # 512 KiB
    optim = {"fc.weight::exp_avg": torch.full((256, 512), fill)}  # 512 KiB
    meta = {"step": step, "architecture": "eagle1", "target": {"hidden_size": 512}}
    return TrainerState(params, optim, torch.zeros(8, dtype=torch.uint8), meta)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp"))


def test_a_full_disk_keeps_the_previous_trainer_checkpoint(small_fs, figures):
    root = small_fs
    first = save_state(_state(1, 1.0), root)
    with pytest.raises(OSError) as info:
        save_state(_state(2, 2.0), root)
    assert info.value.errno == errno.ENOSPC
    assert "drafter checkpoint not written under" in str(info.value), info.value
    assert str(root) in str(info.value)
    # The previous checkpoint is intact and is still the latest.
    assert latest_checkpoint(root) == first
    assert torch.equal(load_state(first).params["fc.weight"], _state(1, 1.0).params["fc.weight"])
    assert _leftovers(root) == []
    figures.update(filesystem="tmpfs", error=str(info.value)[:160], lost_checkpoints=0)


def test_a_full_disk_leaves_no_half_written_drafter_version(small_fs, tmp_path):
    from tests.drafter.helpers import load_target, make_target_dir
    from tltd_workers.engine.eagle import EagleDrafter

    root = small_fs
    target = load_target(make_target_dir(tmp_path / "target", hidden=256, layers=1))
    drafter = EagleDrafter(target)  # its own parameters: ~3 MB in fp32, more than the disk
    filler = root / "filler"
    filler.write_bytes(b"\0" * (FS_BYTES // 2))  # what the disk already holds

    with pytest.raises(OSError) as info:  # the save fails before anything is measured
        versions_mod.measure(
            drafter, [], active=None, policy_version=0, train_steps=1, loss=0.0, out_dir=root
        )
    assert info.value.errno == errno.ENOSPC
    assert "drafter version not written to" in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == ["filler"]  # nothing half-written
