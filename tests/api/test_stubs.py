"""The committed stubs are exactly what the Makefile's pinned `stubs` command generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/tltd/v1").glob("*.proto"))
    assert protos, "no .proto files found"
    # Same command as `make stubs`, with the output directed to a temp dir.
    out = str(tmp_path)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "protos",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    generated = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(ROOT)
        for p in (ROOT / "tltd/v1").iterdir()
        if p.is_file() and p.name != "__init__.py"
    }
    assert generated == committed, "stub files differ in name: run `make stubs` and commit"
    stale = [
        str(f) for f in sorted(generated) if (tmp_path / f).read_bytes() != (ROOT / f).read_bytes()
    ]
    assert not stale, f"stale generated stubs (run `make stubs`): {stale}"


def test_makefile_stubs_command_is_the_one_tested():
    makefile = (ROOT / "Makefile").read_text()
    assert (
        "-m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. "
        "protos/tltd/v1/*.proto"
    ) in makefile
