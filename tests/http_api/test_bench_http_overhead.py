"""Smoke run of benchmarks/bench_http_overhead.py --quick on a tiny random policy."""

from __future__ import annotations

import pytest

from benchmarks import bench_http_overhead
from tests.http_api.support import make_text_checkpoint


@pytest.mark.slow
def test_quick_run_prints_every_path_and_control_route(tmp_path, capsys):
    model = make_text_checkpoint(tmp_path / "policy")
    assert bench_http_overhead.main(["--quick", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    for path in bench_http_overhead.PATHS:
        assert f"| {path:<27} |" in out
    for method, route in bench_http_overhead.CONTROL:
        assert f"| {f'{method} {route}':<38} |" in out
    assert "1.00x" in out  # gRPC against itself
