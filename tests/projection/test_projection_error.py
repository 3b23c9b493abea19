"""The projection's error against measured step costs: real gpu_model figures, synthetic rows."""

from __future__ import annotations

import pytest

from benchmarks.bench_verify_cost import SHAPES as BENCH_CONFIGS
from benchmarks.gpu_model import H100, H200, QWEN25_05B, QWEN25_15B, draft_ms, forward_ms
from benchmarks.projection_error import (
    BENCH_SHAPES,
    compare,
    device_model,
    figures,
    lines,
    median_abs_error,
)

CONTEXT, K = 500, 4


def _row(model: str, batch: int, scale: float, dtype: str = "bfloat16", dev=H200) -> dict:
    """A bench_verify_cost row whose measured ms are `scale` x the projection on `dev`."""
    shape = BENCH_SHAPES.get(model, QWEN25_05B)
    return {"model": model, "dtype": dtype, "batch": batch,
            "decode_ms": scale * forward_ms(dev, shape, batch, 1, CONTEXT),
            "verify_ms": scale * forward_ms(dev, shape, batch, K + 1, CONTEXT),
            "draft_ms": scale * draft_ms(dev, shape, batch, CONTEXT)}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BENCH_SHAPES))
def test_the_projection_s_shapes_have_the_random_models_exact_dimensions(name):
    cfg, shape = BENCH_CONFIGS[name], BENCH_SHAPES[name]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (
        shape.vocab, shape.hidden, shape.intermediate, shape.layers, shape.heads,
        shape.kv_heads, shape.head_dim, shape.tied)  # fmt: skip


@pytest.mark.parametrize(
    ("cuda_name", "model"),
    [("NVIDIA H200", H200), ("NVIDIA H100 80GB HBM3", H100), ("NVIDIA H100 PCIe", None),
     ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None), ("NVIDIA A100-SXM4-80GB", None),
     ("cpu", None)],
)  # fmt: skip
def test_the_device_model_is_picked_by_name_and_never_guessed(cuda_name, model):
    assert device_model(cuda_name) is model


def test_a_measurement_equal_to_the_projection_is_0_percent_and_twice_it_plus_100():
    rows = [_row("qwen2-0.5b", 1, 1.0), _row("qwen2-1.5b", 16, 2.0)]
    c = compare(rows, "NVIDIA H200", CONTEXT, K)
    assert c.device == H200.name and len(c.rows) == 6
    by = {(r.model, r.kind): r for r in c.rows}
    for kind in ("decode", "verify", "draft"):
        assert by["qwen2-0.5b", kind].error_pct == pytest.approx(0.0, abs=1e-9)
        assert by["qwen2-1.5b", kind].error_pct == pytest.approx(100.0)
    assert by["qwen2-1.5b", "verify"].width == K + 1 and by["qwen2-1.5b", "draft"].width == 1
    assert by["qwen2-1.5b", "decode"].projected_ms == forward_ms(H200, QWEN25_15B, 16, 1, CONTEXT)
    assert median_abs_error(c.rows) == pytest.approx({"decode": 50, "verify": 50, "draft": 50})


def test_a_faster_measurement_is_a_negative_error_and_the_median_is_of_its_size():
    rows = [_row("qwen2-0.5b", 4, 0.5), _row("qwen2-0.5b", 1, 1.0), _row("qwen2-0.5b", 8, 1.1)]
    c = compare(rows, "NVIDIA H200", CONTEXT, K)
    assert sorted(round(r.error_pct) for r in c.rows if r.kind == "draft") == [-50, 0, 10]
    assert median_abs_error(c.rows)["draft"] == pytest.approx(10.0)


def test_only_bf16_rows_of_modelled_shapes_are_projected():
    rows = [_row("qwen2-0.5b", 1, 1.0, dtype="float32"), _row("shipped", 1, 1.0),
            _row("qwen2-1.5b", 4, 1.0)]  # fmt: skip
    c = compare(rows, "NVIDIA H100 80GB HBM3", CONTEXT, K)
    assert {(r.model, r.batch) for r in c.rows} == {("qwen2-1.5b", 4)}
    assert c.unmodelled == ["shipped"]
    assert "not projected (no Shape of their dimensions): shipped" in lines(c)


def test_an_unknown_device_gets_no_projection_and_says_so():
    for name in ("cpu", "NVIDIA A100-SXM4-80GB"):
        c = compare([_row("qwen2-0.5b", 1, 1.0)], name, CONTEXT, K)
        assert c.device is None and c.rows == []
        (line,) = lines(c)
        assert "no GPU device model applies" in line and "nothing projected" in line
        assert figures(c)["rows"] == [] and figures(c)["median_abs_error_pct"] == {}


def test_the_printed_table_labels_projection_and_measurement():
    c = compare([_row("qwen2-0.5b", 1, 2.0)], "NVIDIA H200", CONTEXT, K)
    text = "\n".join(lines(c))
    assert "projection (benchmarks/gpu_model.py, H200 SXM) vs measurement" in text
    assert "| projected ms | measured ms | error |" in text
    assert "| qwen2-0.5b | Qwen2.5-0.5B | 1 | verify | 5 |" in text and "+100.0% |" in text
    assert text.splitlines()[-1].startswith("median |error| of the projection against the "
                                            "measurement: decode 100.0%")  # fmt: skip
    assert figures(c)["rows"][0]["error_pct"] == pytest.approx(100.0)
