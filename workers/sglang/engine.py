"""The real engine behind the SGLang port: `sglang.Engine`, imported only when one is built.

This is the only module that touches sglang, and the only part of the backend that cannot run
on the CPU-only machines the tests run on: the worker tests run it over a fake `sglang.Engine`
(tests/rollout/fake_sglang.py), and tests/sglang_contract/ checks the names and arguments it
uses against the real package. SGLang's offline engine is asyncio-based: generations are
tasks on its `engine.loop`, and `poll` runs that loop for at most `timeout` seconds, so the
worker keeps its single-threaded step loop (commands are read between polls).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from tltd_workers.sglang.translate import DistributedJoin, WeightUpdate

# Drafter exports leave this out (the draft model shares the target's embeddings); an export
# that has it must not overwrite the target's with the drafter's possibly older policy's.
_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
# SGLang's memory tags (`GPU_MEMORY_TYPE_KV_CACHE`, `GPU_MEMORY_TYPE_WEIGHTS`).
MEMORY_TAGS = ["kv_cache", "weights"]


def make_engine(args: dict[str, Any]) -> SglangEngineAdapter:
    """The production `EngineFactory`: start `sglang.Engine(**args)` on this process."""
    import sglang  # lazily: the package is present on GPU hosts only
    from sglang.srt.managers import io_struct

    return SglangEngineAdapter(sglang.Engine(**args), io_struct, args)


def tensor_update_request(
    io: ModuleType,
    engine: Any,
    named: list[tuple[str, Any]],
    selector: str,
    version: str,
    flush_cache: bool,
) -> Any:
    """SGLang's request to load `named` tensors into the `selector` runners."""
    return io.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=engine._serialize_tensors_per_rank(named, None),
        flush_cache=flush_cache,
        weight_version=version or None,
        selector=selector,
    )


def disk_update_request(io: ModuleType, path: str, version: str) -> Any:
    """SGLang's request to reload every runner from the checkpoint at `path`."""
    return io.UpdateWeightFromDiskReqInput(model_path=path, weight_version=version or None)


def init_group_request(io: ModuleType, join: DistributedJoin) -> Any:
    """SGLang's request to join the broadcast group (its ranks: rank_offset + tp_rank)."""
    return io.InitWeightsUpdateGroupReqInput(
        master_address=join.address,
        master_port=join.port,
        rank_offset=join.rank_offset,
        world_size=join.world_size,
        group_name=join.group_name,
        backend=join.backend,
    )


def distributed_update_request(io: ModuleType, join: DistributedJoin) -> Any:
    """SGLang's request to receive the broadcast's tensors into the target runner. No
    weight_version: the version exists only once the daemon recorded it (LoadPolicy sets it);
    the draft runner keeps its own weights (it shares embeddings and head with the target)."""
    return io.UpdateWeightsFromDistributedReqInput(
        names=list(join.names),
        dtypes=list(join.dtypes),
        shapes=[list(s) for s in join.shapes],
        group_name=join.group_name,
        flush_cache=True,
        weight_version=None,
        selector="target",
    )


def keep_stop_signals_ignored(tokenizer_manager: Any) -> None:
    """SGLang's TokenizerManager installs a SIGTERM handler on its loop when it first runs
    (`auto_create_handle_loop`), replacing the worker's SIG_IGN: its watchdog would then
    shut the engine down and exit without a drain. The daemon alone stops its workers (see
    `tltd_workers.signals`), so the handler it installs here does nothing."""
    base = tokenizer_manager.signal_handler_class

    class KeepRunning(base):  # type: ignore[misc,valid-type]
        def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
            pass  # the daemon drains this worker through its pipe

    tokenizer_manager.signal_handler_class = KeepRunning


# How long shutdown lets the generate tasks it cancels run to their end.
SHUTDOWN_TASKS_SECONDS = 2.0


class SglangEngineAdapter:
    """`tltd_workers.sglang.translate.SglangEngine` over an `sglang.Engine`; `io` is SGLang's
    `sglang.srt.managers.io_struct` (the request classes), `args` what it was started with."""

    def __init__(self, engine: Any, io: ModuleType, args: dict[str, Any]) -> None:
        self.engine = engine
        self.io = io
        self.tm = engine.tokenizer_manager
        self.loop: asyncio.AbstractEventLoop = engine.loop
        self.has_draft_model = args.get("speculative_algorithm") == "EAGLE"
        self.tasks: dict[asyncio.Task, str] = {}
        self.unregistered_aborts: set[str] = set()
        self.released = False
        self.broadcast: asyncio.Task | None = None
        keep_stop_signals_ignored(self.tm)

    def submit(self, rid: str, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> None:
        self.resume_memory()
        coro = self.engine.async_generate(
            input_ids=list(input_ids),
            sampling_params=dict(sampling_params),
            return_logprob=True,
            rid=rid,
        )
        self.tasks[self.loop.create_task(coro)] = rid

    def poll(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        waiting: list[asyncio.Task] = list(self.tasks)
        if self.broadcast is not None and not self.broadcast.done():
            waiting.append(self.broadcast)  # the loop runs it while it waits
        if not waiting:
            return []
        done, _ = self.loop.run_until_complete(
            asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        )
        outs = []
        for task in done:
            if task is self.broadcast:
                continue
            rid = self.tasks.pop(task)
            self.unregistered_aborts.discard(rid)
            try:
                out = task.result()
            except Exception as exc:  # SGLang raises for a request it rejects (too long, ...)
                reason = {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}
                out = {"output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}}
            outs.append((rid, out))
        self._send_late_aborts()
        return outs

    def abort(self, rid: str) -> None:
        # SGLang drops the abort of a rid its TokenizerManager has not registered yet (until
        # the generate task has run): such aborts are sent once it has.
        if rid in self.tm.rid_to_state:
            self.tm.abort_request(rid=rid)
        elif rid in self.tasks.values():
            self.unregistered_aborts.add(rid)

    def abort_all(self) -> None:
        self.tm.abort_request(abort_all=True)
        registered = self.tm.rid_to_state
        self.unregistered_aborts |= {rid for rid in self.tasks.values() if rid not in registered}

    def _send_late_aborts(self) -> None:
        for rid in [r for r in self.unregistered_aborts if r in self.tm.rid_to_state]:
            self.unregistered_aborts.discard(rid)
            self.tm.abort_request(rid=rid)

    # -- weights --------------------------------------------------------------------------

    def update_weights(self, update: WeightUpdate) -> bool:
        self.resume_memory()
        if update.selector == "draft":
            if not self.has_draft_model:
                return False  # no draft runner to load into: a restart brings one
            tensors = _load(Path(update.path) / "model.safetensors")
            named = [(k, v) for k, v in tensors.items() if k not in _SHARED_WITH_TARGET]
            # No cache flush: the target's KV cache stays valid under a new drafter, and
            # running requests go on.
            self._update_from_tensors([named], "draft", update.weight_version, flush=False)
            return True
        if self.has_draft_model:
            # A disk update reloads every runner, the draft too, from the target checkpoint:
            # the target's tensors go to the target runner only, one file at a time.
            files = sorted(Path(update.path).glob("*.safetensors"))
            if not files:
                raise RuntimeError(f"weight update from {update.path}: no *.safetensors")
            chunks = (list(_load(f).items()) for f in files)
            self._update_from_tensors(chunks, "target", update.weight_version, flush=True)
            return True
        request = disk_update_request(self.io, update.path, update.weight_version)
        result = self._run(self.tm.update_weights_from_disk(request, None))
        _check(result, f"update_weights_from_disk({update.path})")
        return True

    def _update_from_tensors(
        self, chunks: Any, selector: str, version: str, *, flush: bool
    ) -> None:
        """One selector-scoped weight-update session over `chunks` of named tensors; the
        version and the cache flush go with the last chunk."""
        _check(self.engine.begin_weight_update(selector), f"begin_weight_update({selector})")
        try:
            for named, last in _with_last(chunks):
                request = tensor_update_request(
                    self.io, self.engine, named, selector, version if last else "", flush and last
                )
                result = self._run(self.tm.update_weights_from_tensor(request, None))
                _check(result, f"{selector} weight update")
        finally:
            _check(self.engine.end_weight_update(), "end_weight_update")

    # -- a policy broadcast ---------------------------------------------------------------

    def start_broadcast(self, join: DistributedJoin) -> None:
        self.resume_memory()
        self.broadcast = self.loop.create_task(self._receive(join))

    async def _receive(self, join: DistributedJoin) -> None:
        # A task on the engine's loop, not a blocking call: the group forms only once the
        # trainer joins, and the worker keeps answering its pipe meanwhile.
        tm, io = self.tm, self.io
        begin = await tm.begin_weight_update(io.BeginWeightUpdateReqInput(selector="target"))
        _check(begin, "begin_weight_update(target)")
        try:
            joined = await tm.init_weights_update_group(init_group_request(io, join), None)
            _check(joined, f"init_weights_update_group({join.group_name})")
            try:
                update = distributed_update_request(io, join)
                result = await tm.update_weights_from_distributed(update, None)
                _check(result, "update_weights_from_distributed")
            finally:
                destroy = io.DestroyWeightsUpdateGroupReqInput(group_name=join.group_name)
                await tm.destroy_weights_update_group(destroy, None)
        finally:
            _check(await tm.end_weight_update(io.EndWeightUpdateReqInput()), "end_weight_update")

    def broadcast_result(self) -> tuple[bool, str] | None:
        task = self.broadcast
        if task is None or not task.done():
            return None
        self.broadcast = None
        exc = task.exception()
        return (True, "") if exc is None else (False, f"{type(exc).__name__}: {exc}")

    def set_weight_version(self, version: str) -> None:
        request = self.io.UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        self._run(self.tm.update_weight_version(request))

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # -- memory ---------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Give the GPU memory of the KV cache and the weights back (the weights wait in host
        memory) while no request runs, so that the drafter trainer can use the device."""
        if not self.released and not self.tasks:
            self.engine.release_memory_occupation(tags=MEMORY_TAGS)
            self.released = True

    def resume_memory(self) -> None:
        if self.released:
            self.engine.resume_memory_occupation(tags=MEMORY_TAGS)
            self.released = False

    def shutdown(self) -> None:
        pending = [*self.tasks, *([self.broadcast] if self.broadcast is not None else [])]
        for task in pending:
            task.cancel()
        self.tasks.clear()
        self.broadcast = None
        if pending and not self.loop.is_closed() and not self.loop.is_running():
            # A task cancelled before the loop ever ran it has not started its coroutine:
            # a turn of the loop lets each one end (and SGLang's own clean-up run), bounded
            # so that a clean-up that waits on a dead scheduler cannot hold the shutdown.
            self.loop.run_until_complete(asyncio.wait(pending, timeout=SHUTDOWN_TASKS_SECONDS))
        self.engine.shutdown()


def _load(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _with_last(items: Any) -> Iterator[tuple[Any, bool]]:
    """(item, is_last) over an iterable, reading one item ahead."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _check(result: Any, what: str) -> None:
    """SGLang answers weight operations with (success, message, ...) or an object with
    `success` and `message`."""
    if isinstance(result, tuple) and result:
        ok, message = result[0], result[1] if len(result) > 1 else "no message"
    elif hasattr(result, "success"):
        ok, message = result.success, getattr(result, "message", "no message")
    else:
        return
    if not ok:
        raise RuntimeError(f"{what} failed: {message}")
