"""The real engine behind the SGLang port: `sglang.Engine`, imported only when one is built.

This is the only module that touches sglang, and the only part of the backend that cannot run
on the CPU-only machines the tests run on (the worker's logic is tested against a fake with
the same methods). SGLang's offline engine is asyncio-based: generations are tasks on its
`engine.loop`, and `poll` runs that loop for at most `timeout` seconds, so the worker keeps
its single-threaded step loop (commands are read between polls).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.sglang.adapter import WeightUpdate


def make_engine(args: dict[str, Any]) -> SglangEngineAdapter:
    """The production `EngineFactory`: start `sglang.Engine(**args)` on this process."""
    import sglang  # lazily: the package is present on GPU hosts only

    return SglangEngineAdapter(sglang.Engine(**args))


class SglangEngineAdapter:
    """`workers.sglang.adapter.SglangEngine` over an `sglang.Engine`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop = engine.loop
        self.tasks: dict[asyncio.Task, str] = {}

    def submit(self, rid: str, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> None:
        coro = self.engine.async_generate(
            input_ids=list(input_ids),
            sampling_params=dict(sampling_params),
            return_logprob=True,
            rid=rid,
        )
        self.tasks[self.loop.create_task(coro)] = rid

    def poll(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        if not self.tasks:
            return []
        done, _ = self.loop.run_until_complete(
            asyncio.wait(list(self.tasks), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        )
        outs = []
        for task in done:
            rid = self.tasks.pop(task)
            try:
                out = task.result()
            except Exception as exc:  # SGLang raises for a request it rejects (too long, ...)
                reason = {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}
                out = {"output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}}
            outs.append((rid, out))
        return outs

    def abort(self, rid: str) -> None:
        self.engine.tokenizer_manager.abort_request(rid=rid)

    def update_weights(self, update: WeightUpdate) -> bool:
        if update.selector == "target":
            result = self.engine.update_weights_from_disk(update.path)
            _check(result, f"update_weights_from_disk({update.path})")
            return True
        # Stock SGLang has no draft-weight update; TLT's fork (mit-han-lab/fastrl) routes
        # update_weights_from_tensor(..., is_draft_model=True) to the draft worker.
        update_tensors = self.engine.update_weights_from_tensor
        if "is_draft_model" not in inspect.signature(update_tensors).parameters:
            return False
        from safetensors.torch import load_file

        tensors = load_file(str(Path(update.path) / "model.safetensors"))
        # The draft model shares the target's embeddings: loading the export's copy would
        # overwrite the target's with the drafter's (possibly older) policy's.
        named = [(k, v) for k, v in tensors.items() if k != "embed_tokens.weight"]
        _check(update_tensors(named, is_draft_model=True), "draft weight update")
        return True

    def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()
        self.engine.shutdown()


def _check(result: Any, what: str) -> None:
    """SGLang answers weight updates with (success, message, ...)."""
    if isinstance(result, tuple) and result and not result[0]:
        message = result[1] if len(result) > 1 else "no message"
        raise RuntimeError(f"{what} failed: {message}")
