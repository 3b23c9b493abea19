"""The roofline projection (gpu_model.py) against step costs measured on a GPU: its error per row.

bench_verify_cost's rows (decode, verify and draft-step ms per batch, measured) go in; for each
bf16 row of a model whose dimensions the projection has a `Shape` for, and a CUDA device it has
a `Device` for, out come the projected ms, the measured ms and the signed error
(measured / projected - 1: +100% is a measurement twice the projection). Nothing is guessed:
another device, or a model without a matching Shape, gets no projection, and the lines say so.

The projected verify is `forward_ms` of k + 1 new tokens without the SD step's bookkeeping
(`sd_ms`, `sd_row_ms`), because bench_verify_cost times the forward alone.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from benchmarks.gpu_model import H100, H200, QWEN25_05B, QWEN25_15B, Device, Shape, draft_ms
from benchmarks.gpu_model import forward_ms as projected_forward_ms

# bench_verify_cost's random-model shapes -> the projection's Shape of the same dimensions.
BENCH_SHAPES: dict[str, Shape] = {"qwen2-0.5b": QWEN25_05B, "qwen2-1.5b": QWEN25_15B}
KINDS = ("decode", "verify", "draft")


def device_model(cuda_name: str) -> Device | None:
    """The Device for a CUDA device name: H100 or H200 SXM; None for anything else (PCIe and
    NVL parts, GH200 included: their bandwidth and peak differ from the SXM figures)."""
    m = re.search(r"\bH(100|200)\b", cuda_name)
    if m is None or re.search(r"PCIe|NVL", cuda_name, re.IGNORECASE):
        return None
    return H100 if m.group(1) == "100" else H200


@dataclass(frozen=True)
class ErrorRow:
    """One measured cost beside its projection."""

    model: str  # bench_verify_cost's label (a SHAPES key)
    shape: str  # the projection's Shape
    batch: int
    kind: str  # decode | verify | draft
    width: int  # new tokens a row (1 for decode and a draft step)
    projected_ms: float
    measured_ms: float

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.measured_ms / self.projected_ms - 1.0)


@dataclass(frozen=True)
class Comparison:
    """The projection against one device's measured rows."""

    cuda_name: str
    device: str | None  # the Device's name; None: no device model, nothing projected
    context: int
    k: int
    rows: list[ErrorRow] = field(default_factory=list)
    unmodelled: list[str] = field(default_factory=list)  # bf16 models without a Shape


def _projected(dev: Device, shape: Shape, row: Mapping, context: int, k: int) -> list[tuple]:
    b = int(row["batch"])
    return [
        ("decode", 1, projected_forward_ms(dev, shape, b, 1, context), row["decode_ms"]),
        ("verify", k + 1, projected_forward_ms(dev, shape, b, k + 1, context), row["verify_ms"]),
        ("draft", 1, draft_ms(dev, shape, b, context), row["draft_ms"]),
    ]


def compare(rows: Iterable[Mapping], cuda_name: str, context: int, k: int) -> Comparison:
    """The projection of every bf16 row with a Shape on the device named `cuda_name`."""
    dev = device_model(cuda_name)
    bf16 = [r for r in rows if r.get("dtype") == "bfloat16"]
    unmodelled = sorted({str(r.get("model")) for r in bf16 if r.get("model") not in BENCH_SHAPES})
    out = Comparison(cuda_name, dev and dev.name, context, k, unmodelled=unmodelled)
    if dev is None:
        return out
    for r in bf16:
        shape = BENCH_SHAPES.get(r.get("model"))
        if shape is None:
            continue
        for kind, width, proj, meas in _projected(dev, shape, r, context, k):
            out.rows.append(
                ErrorRow(r["model"], shape.name, int(r["batch"]), kind, width, proj, float(meas))
            )
    return out


def median_abs_error(rows: Iterable[ErrorRow]) -> dict[str, float]:
    """Median |error| % per kind (kinds without rows left out)."""
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r.kind, []).append(abs(r.error_pct))
    return {k: statistics.median(by_kind[k]) for k in KINDS if k in by_kind}


def figures(c: Comparison) -> dict:
    """The comparison for report.json: every row with its error, and the medians."""
    rows = [asdict(r) | {"error_pct": r.error_pct} for r in c.rows]
    return {"cuda_name": c.cuda_name, "device_model": c.device, "context": c.context, "k": c.k,
            "rows": rows, "median_abs_error_pct": median_abs_error(c.rows),
            "unmodelled_models": c.unmodelled}  # fmt: skip


def lines(c: Comparison) -> list[str]:
    """The comparison for a reader, every figure labelled projection or measurement."""
    if c.device is None:
        return [
            f"projection vs measurement: no GPU device model applies to {c.cuda_name!r} "
            "(benchmarks/gpu_model.py models the H100 and H200 SXM): nothing projected"
        ]
    out = [f"projection (benchmarks/gpu_model.py, {c.device}) vs measurement (bench_verify_cost "
           f"on {c.cuda_name}), bf16, context {c.context}, k {c.k}; error = measured / "
           "projected - 1",
           "| model | projection shape | batch | kind | new tokens a row | projected ms "
           "| measured ms | error |",
           "|---|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in c.rows:
        out.append(
            f"| {r.model} | {r.shape} | {r.batch} | {r.kind} | {r.width} "
            f"| {r.projected_ms:.3f} | {r.measured_ms:.3f} | {r.error_pct:+.1f}% |"
        )
    med = median_abs_error(c.rows)
    cells = ", ".join(f"{k} {v:.1f}%" for k, v in med.items()) or "no modelled rows"
    out.append(f"median |error| of the projection against the measurement: {cells}")
    if c.unmodelled:
        out.append(f"not projected (no Shape of their dimensions): {', '.join(c.unmodelled)}")
    return out
