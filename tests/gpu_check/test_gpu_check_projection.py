"""The GPU check's verify step records and prints the projection's error on its measured rows."""

from __future__ import annotations

from pathlib import Path

from scripts.gpu_check import Check, StepResult, _projection, write_report

ROWS = [
    {"model": "qwen2-0.5b", "dtype": "bfloat16", "batch": 1, "decode_ms": 7.8, "verify_ms": 8.1,
     "draft_ms": 1.0, "decode_cuda_ms": 7.0},
    {"model": "shipped", "dtype": "bfloat16", "batch": 1, "decode_ms": 5.6, "verify_ms": 6.0,
     "draft_ms": 0.8, "decode_cuda_ms": 5.0},
]  # fmt: skip


def test_an_h200_s_rows_are_projected_and_the_report_prints_them(tmp_path: Path):
    proj = _projection(ROWS, {"device_name": "NVIDIA H200", "context": 500, "k": 4})
    assert proj["device_model"] == "H200 SXM" and len(proj["rows"]) == 3
    assert proj["unmodelled_models"] == ["shipped"]
    assert set(proj["median_abs_error_pct"]) == {"decode", "verify", "draft"}
    res = StepResult("verify", "ok", figures={"device": "cuda", "rows": ROWS, "projection": proj})
    c = Check("cuda", dry=False, tmp=tmp_path, deadline=0.0)
    write_report(tmp_path, c, [res], 450)
    text = (tmp_path / "report.txt").read_text()
    assert "projection (benchmarks/gpu_model.py, H200 SXM) vs measurement" in text
    assert "| qwen2-0.5b | Qwen2.5-0.5B | 1 | decode | 1 |" in text


def test_on_the_cpu_nothing_is_projected_and_a_broken_input_is_recorded_not_raised():
    proj = _projection(ROWS, {"device_name": "cpu", "context": 64, "k": 4})
    assert proj["rows"] == [] and "no GPU device model applies" in proj["lines"][0]
    broken = _projection(ROWS, {})  # no JSON came back: no context, no k
    assert "not computed" in broken["error"] and broken["lines"] == [broken["error"]]
