"""The simulated engine's settings (`Settings.sim_engine`): its cost model and answer lengths."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist

# p99 of a standard normal: a log-normal with p99 / p50 = tail has sigma = ln(tail) / this.
_Z99 = NormalDist().inv_cdf(0.99)


@dataclass(frozen=True)
class SimConfig:
    """A decode step of `rows` samples holding `context` tokens in all costs
    `step_ms + rows * row_us / 1e3 + context * kv_ns / 1e6` ms (a GPU's memory-bound decode:
    the weights once, then every row's KV cache), and admitting a sample costs `prefill_us`
    per prompt token. All zero: the engine costs nothing. Answer lengths are log-normal with
    median `median` and p99 / p50 `tail`, or drawn from the lengths in file `trace` (one per
    line), capped by the request's max_new_tokens; `median` 0 and no trace: every answer
    runs to the cap. The engine waits by sleeping: it uses no CPU for its simulated time."""

    step_ms: float = 0.0
    row_us: float = 0.0
    kv_ns: float = 0.0
    prefill_us: float = 0.0
    median: int = 0
    tail: float = 10.0
    trace: str = ""
    seed: int = 0

    @property
    def sigma(self) -> float:
        return math.log(self.tail) / _Z99

    def step_seconds(self, rows: int, context: int) -> float:
        """One decode step of `rows` rows holding `context` tokens in all."""
        return (self.step_ms + rows * self.row_us / 1e3 + context * self.kv_ns / 1e6) / 1e3

    @property
    def free(self) -> bool:
        """Whether nothing costs time."""
        return not (self.step_ms or self.row_us or self.kv_ns or self.prefill_us)


_NUMBERS = {f.name: f.type for f in dataclasses.fields(SimConfig)}


def parse_sim(text: str) -> SimConfig:
    """`Settings.sim_engine` as a SimConfig: "zero" (no costs, every answer to its cap) or
    comma-separated key=value of SimConfig's fields, e.g. "step_ms=6.3,kv_ns=21,median=1500".
    ValueError names what is wrong."""
    values: dict[str, object] = {}
    for part in text.split(","):
        part = part.strip()
        if not part or part == "zero":
            continue
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or key not in _NUMBERS:
            raise ValueError(
                f"sim_engine: {part!r} is not key=value of {', '.join(_NUMBERS)} (or 'zero')"
            )
        kind = _NUMBERS[key]
        try:
            values[key] = raw.strip() if kind == "str" else (int if kind == "int" else float)(raw)
        except ValueError:
            raise ValueError(f"sim_engine: {key} must be a number, got {raw!r}") from None
    cfg = SimConfig(**values)  # type: ignore[arg-type]
    costs = (cfg.step_ms, cfg.row_us, cfg.kv_ns, cfg.prefill_us, cfg.median)
    if any(not math.isfinite(x) or x < 0 for x in costs):
        raise ValueError("sim_engine: costs and median must be finite and >= 0")
    if not (math.isfinite(cfg.tail) and cfg.tail >= 1.0):
        raise ValueError(f"sim_engine: tail must be >= 1, got {cfg.tail}")
    return cfg
