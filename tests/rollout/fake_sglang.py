"""A fake `sglang.Engine`: the one fake of the sglang backend (no GPU here to run SGLang).

The worker tests run the real `tltd_workers.sglang.engine.SglangEngineAdapter` over it, so it
answers as SGLang 0.5.23 does where the adapter depends on it (checked against the real
package by tests/sglang_contract/):
- `async_generate(input_ids=..., sampling_params=..., return_logprob=True, rid=...)` returns
  `output_ids` and `meta_info` (`output_token_logprobs` [(logprob, id, None)], `finish_reason`
  {"type": "stop"|"length"|"abort", ...}, `completion_tokens`, `weight_version`, and with a
  speculative algorithm `spec_verify_ct`; EAGLE also `spec_num_correct_drafts`,
  `spec_num_proposed_drafts`, `spec_correct_drafts_histogram`). It refuses what SGLang
  refuses: a model path without config.json, an EAGLE draft path that is not an EAGLE
  checkpoint, sampling params that `SamplingParams.verify` rejects.
- `ignore_eos` skips every stop check, `stop_token_ids` included (`Req._check_token_based_
  finish`); without it the model's EOS ids (config.json `eos_token_id`) stop too.
- The TokenizerManager registers a request in `rid_to_state` only once its generate task has
  run; `abort_request(rid)` of a rid not registered yet does nothing.
- On its first request the TokenizerManager installs `signal_handler_class(tm).sigterm_handler`
  for SIGTERM on the loop; once called, its watchdog shuts the engine down.
- Weight updates: `update_weights_from_tensor` only between `begin_weight_update(selector)`
  and `end_weight_update()`, to the runners `selector` names; `update_weights_from_disk`
  reloads every runner, the draft too; both set `weight_version` when given one.
- `release_memory_occupation` only while no request runs; generating while released fails.
- Distributed weight updates: `init_weights_update_group` joins the trainer's gloo group as
  SGLang does (a `tcp://` rendezvous as a client of the master's TCP store, the store keys
  `init_custom_process_group` and torch's group helper build, ranks rank_offset + tp_rank, one
  per tensor-parallel rank); `update_weights_from_distributed` only inside a weight-update
  session, receives every tensor from rank 0 (all broadcasts posted, then waited, as SGLang's
  receive) and loads them only once all arrived; it fails when requests still run (SGLang
  refuses the cache flush); no decoding while it receives. The blocking parts run on a thread,
  as they run in SGLang's scheduler process while the TokenizerManager's loop awaits them.

SGLang's scheduler decodes in its own process while the loop waits; here one decode step
(`tokens_per_step` tokens for every registered request) runs each time the loop is entered,
so a test's outputs do not depend on timing. The next token is a function of the context
(prompt + output so far), so a sample carried over a restart continues exactly as it would.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import signal
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from tltd_workers.sglang.engine import SglangEngineAdapter

VOCAB = 50
LOG_ENV = "TLTD_FAKE_SGLANG_LOG"  # a JSONL file the fake appends its calls to (process tests)


def next_token(context: list[int]) -> int:
    tail = context[-4:]
    return (sum((i + 1) * t for i, t in enumerate(tail)) * 7 + len(context)) % VOCAB


def token_logprob(context: list[int], token: int) -> float:
    return -0.05 - ((token + len(context)) % 9) / 4


def reference(prompt: list[int], max_new: int, stop: tuple[int, ...] = ()) -> list[int]:
    """What the fake generates for `prompt` from scratch, stopping only at `stop`."""
    out: list[int] = []
    while len(out) < max_new:
        out.append(next_token(prompt + out))
        if out[-1] in stop:
            break
    return out


# ---- io_struct: the request classes the adapter builds (same fields as SGLang's) -----------


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass(kw_only=True)
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReqInput:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


io_struct = types.SimpleNamespace(
    UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
    UpdateWeightFromDiskReqInput=UpdateWeightFromDiskReqInput,
    BeginWeightUpdateReqInput=BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput=EndWeightUpdateReqInput,
    InitWeightsUpdateGroupReqInput=InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput=UpdateWeightsFromDistributedReqInput,
    DestroyWeightsUpdateGroupReqInput=DestroyWeightsUpdateGroupReqInput,
    UpdateWeightVersionReqInput=UpdateWeightVersionReqInput,
)


# ---- the engine --------------------------------------------------------------------------


@dataclass
class _Gen:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    done: asyncio.Future
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[dict[str, Any]] = field(default_factory=list)
    abort_requested: bool = False


class _SignalHandler:
    """SGLang's `SignalHandler`: SIGTERM starts the graceful exit."""

    def __init__(self, tokenizer_manager: FakeTokenizerManager) -> None:
        self.tokenizer_manager = tokenizer_manager

    def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
        self.tokenizer_manager.gracefully_exit = True


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.rid_to_state: dict[str, _Gen] = {}
        self.signal_handler_class: type = _SignalHandler
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.gracefully_exit = False
        self.abort_calls: list[tuple[str, bool]] = []

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        self.event_loop = loop = self.engine.loop
        if threading.current_thread() is threading.main_thread():
            handler = self.signal_handler_class(self)
            self.engine.saved_sigterm = signal.getsignal(signal.SIGTERM)
            loop.add_signal_handler(signal.SIGTERM, handler.sigterm_handler)
        loop.create_task(self._sigterm_watchdog())

    async def _sigterm_watchdog(self) -> None:
        while not self.gracefully_exit:
            await asyncio.sleep(0.01)
        while self.rid_to_state:
            await asyncio.sleep(0.01)
        self.engine.exited = True  # SGLang kills its processes and the engine is gone

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.abort_calls.append((rid, abort_all))
        if abort_all:
            targets = list(self.rid_to_state.values())
        elif rid in self.rid_to_state:
            targets = [self.rid_to_state[rid]]
        else:
            return  # SGLang: an unknown rid is ignored
        for g in targets:
            g.abort_requested = True
            self.engine.aborted.append(g.rid)
            self.engine._log("abort", rid=g.rid)

    async def update_weights_from_tensor(self, obj: Any, request: Any = None):
        e = self.engine
        if e.session is None:
            return False, (
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        names = [n for n, _ in obj.serialized_named_tensors[0]]
        e._record_update("tensor", obj.selector, names, obj.weight_version, obj.flush_cache)
        return True, "Success"

    async def begin_weight_update(self, obj: Any, request: Any = None):
        e = self.engine
        if e.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        e.session = obj.selector
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: Any = None):
        e = self.engine
        if e.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        e.session = None
        return True, "Success"

    async def init_weights_update_group(self, obj: Any, request: Any = None):
        self.auto_create_handle_loop()
        try:
            await asyncio.to_thread(self.engine._join_group, obj)
        except Exception as exc:
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, obj: Any, request: Any = None):
        e = self.engine
        if e.session is None:
            return False, (
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        e.receiving = True
        try:
            received = await asyncio.to_thread(e._receive_group, obj)
        except Exception as exc:
            return False, f"Failed to receive weights: {exc}"
        finally:
            e.receiving = False
        e.weights.update(received)
        checksums = {
            n: hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in received.items()
        }
        e._log("received", group=obj.group_name, checksums=checksums)
        e._record_update("distributed", obj.selector, list(received), obj.weight_version, True)
        if obj.flush_cache and self.rid_to_state:
            return False, (
                "Weights were updated, but the cache was not flushed because requests are "
                "still running or queued."
            )
        return True, "Succeeded to update parameter online."

    async def destroy_weights_update_group(self, obj: Any, request: Any = None):
        if self.engine.groups.pop(obj.group_name, None) is None:
            return False, "The group to be destroyed does not exist."
        return True, "Succeeded to destroy custom process group."

    async def update_weight_version(self, obj: Any) -> None:
        self.auto_create_handle_loop()
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        self.engine._set_version(obj.new_version)

    async def update_weights_from_disk(self, obj: Any, request: Any = None):
        e = self.engine
        if not (Path(obj.model_path) / "config.json").is_file():
            return False, f"Failed to get weights iterator: no checkpoint at {obj.model_path}", 0
        e._record_update("disk", "all", [obj.model_path], obj.weight_version, obj.flush_cache)
        return True, "Succeeded to update model weights.", 0


class _SteppingLoop(asyncio.SelectorEventLoop):
    """Runs one decode step of its engine each time it is entered."""

    engine: FakeEngine | None = None

    def run_until_complete(self, future):
        engine = self.engine
        if engine is not None and not engine.exited:
            for _ in range(3):  # let new generate tasks run up to their registration
                super().run_until_complete(asyncio.sleep(0))
            engine._decode_step()
        return super().run_until_complete(future)


class FakeEngine:
    """`sglang.Engine` as the adapter uses it (see the module docstring)."""

    instances: ClassVar[list[FakeEngine]] = []  # every engine built, in order
    refuse_eagle: ClassVar[bool] = False  # an EAGLE engine fails to start (out of memory)
    tokens_per_step: ClassVar[int] = 3

    def __init__(self, **args: Any) -> None:
        model = Path(args["model_path"])
        if not (model / "config.json").is_file():
            raise OSError(f"no config.json in {args['model_path']}")
        eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        algo = args.get("speculative_algorithm")
        if algo == "EAGLE":
            draft = str(args["speculative_draft_model_path"])
            cfg = json.loads((Path(draft) / "config.json").read_text())
            if not cfg["architectures"][0].endswith("ForCausalLMEagle"):
                raise ValueError(f"{draft} is not an EAGLE checkpoint")
            if self.refuse_eagle:
                raise RuntimeError("CUDA out of memory (fake)")
        self.args = dict(args)
        self.weight_version = str(args.get("weight_version", "default"))
        self.loop = _SteppingLoop()
        self.loop.engine = self
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.submitted: list[tuple[str, list[int], dict[str, Any]]] = []
        self.aborted: list[str] = []
        self.updates: list[dict[str, Any]] = []
        self.session: str | None = None
        self.groups: dict[str, list[Any]] = {}  # weight-update groups: one per TP rank
        self.weights: dict[str, Any] = {}  # what distributed updates loaded, by name
        self.receiving = False
        self.released = False
        self.memory_calls: list[str] = []
        self.closed = self.exited = False
        self.saved_sigterm: Any = None
        FakeEngine.instances.append(self)
        self._log("start", args=args)

    def _log(self, event: str, **data: Any) -> None:
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"event": event, **data}) + "\n")

    # -- generation -----------------------------------------------------------------------

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        rid: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        tm = self.tokenizer_manager
        tm.auto_create_handle_loop()
        if self.closed or self.exited:
            raise RuntimeError("the engine has shut down")
        if self.released:
            raise RuntimeError("generate while the GPU memory is released")
        p = dict(sampling_params or {})
        if not (p.get("top_k", -1) == -1 or p["top_k"] >= 1):
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        if not 0 < p.get("top_p", 1.0) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p['top_p']}.")
        assert p.get("n", 1) == 1 and p["max_new_tokens"] > 0 and return_logprob and rid
        self.submitted.append((rid, list(input_ids or []), p))
        self._log("submit", rid=rid, pid=os.getpid(), input_ids=list(input_ids or []), params=p)
        await asyncio.sleep(0)  # tokenization: until then the rid is unknown to aborts
        g = _Gen(rid, list(input_ids or []), p, self.loop.create_future())
        g.versions.append({"version": self.weight_version, "start": 0, "end": 0})
        tm.rid_to_state[rid] = g
        return await g.done

    def _decode_step(self) -> None:
        if self.receiving:  # SGLang's scheduler is inside the collective
            return
        for g in list(self.tokenizer_manager.rid_to_state.values()):
            if g.abort_requested:
                self._finish(g, {"type": "abort", "message": "Abort in waiting queue"})
                continue
            p = g.params
            stop = set() if p.get("ignore_eos") else set(p.get("stop_token_ids") or ())
            eos = set() if p.get("ignore_eos") else self.eos_token_ids
            reason = None
            for _ in range(self.tokens_per_step):
                ctx = g.input_ids + g.out
                tok = next_token(ctx)
                g.out.append(tok)
                g.logprobs.append(token_logprob(ctx, tok))
                if tok in stop or tok in eos:
                    reason = {"type": "stop", "matched": tok}
                    break
                if len(g.out) >= p["max_new_tokens"]:
                    reason = {"type": "length", "length": len(g.out)}
                    break
            if reason is not None:
                self._finish(g, reason)

    def _finish(self, g: _Gen, reason: dict[str, Any]) -> None:
        del self.tokenizer_manager.rid_to_state[g.rid]
        n = len(g.out)
        spans = [dict(s, end=min(s["end"] or n, n)) for s in g.versions]
        meta: dict[str, Any] = {
            "id": g.rid,
            "finish_reason": reason,
            "prompt_tokens": len(g.input_ids),
            "completion_tokens": n,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "output_token_logprobs": [
                (lp, t, None) for lp, t in zip(g.logprobs, g.out, strict=True)
            ],
        }
        algo = self.args.get("speculative_algorithm")
        if algo and n > 1:
            verify = n // 2  # each verify pass gains 2 tokens (1 accepted + bonus)
            meta["spec_verify_ct"] = verify
            if algo == "EAGLE":  # NGRAM answers without it: the worker derives it
                steps = int(self.args["speculative_num_steps"])
                meta["spec_num_correct_drafts"] = n - 1 - verify
                meta["spec_num_proposed_drafts"] = verify * steps
                meta["spec_correct_drafts_histogram"] = [0, verify]
        if not g.done.done():  # as in SGLang, a cancelled generate's request still runs
            g.done.set_result({"output_ids": list(g.out), "meta_info": meta})

    # -- weights and memory ---------------------------------------------------------------

    def _record_update(self, kind: str, selector: str, names: list[str], version, flush) -> None:
        runners = ["target", "draft"] if selector == "all" else [selector]
        if self.args.get("speculative_algorithm") != "EAGLE":
            runners = [r for r in runners if r != "draft"]  # no draft runner to load into
        self.updates.append(
            {"kind": kind, "runners": runners, "names": names, "version": version, "flush": flush}
        )
        self._log("update_weights", kind=kind, runners=runners)
        if version is not None:
            self._set_version(version)

    def _set_version(self, version: str) -> None:
        # Running requests with tokens get a new version span.
        for g in self.tokenizer_manager.rid_to_state.values():
            if g.out:
                g.versions[-1]["end"] = len(g.out)
                g.versions.append({"version": version, "start": len(g.out), "end": 0})
            else:
                g.versions[-1]["version"] = version
        self.weight_version = version
        self._log("weight_version", version=version)

    def begin_weight_update(self, selector: str = "all"):
        obj = BeginWeightUpdateReqInput(selector=selector)
        return self.loop.run_until_complete(self.tokenizer_manager.begin_weight_update(obj))

    def end_weight_update(self):
        obj = EndWeightUpdateReqInput()
        return self.loop.run_until_complete(self.tokenizer_manager.end_weight_update(obj))

    # -- distributed weight updates (SGLang's Engine methods, and what its scheduler does) --

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        obj = InitWeightsUpdateGroupReqInput(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return self.loop.run_until_complete(self.tokenizer_manager.init_weights_update_group(obj))

    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name="weight_update_group",
        flush_cache=True,
        load_format=None,
    ):
        obj = UpdateWeightsFromDistributedReqInput(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        coro = self.tokenizer_manager.update_weights_from_distributed(obj)
        return self.loop.run_until_complete(coro)

    def destroy_weights_update_group(self, group_name):
        obj = DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        coro = self.tokenizer_manager.destroy_weights_update_group(obj)
        return self.loop.run_until_complete(coro)

    def _join_group(self, obj: Any) -> None:
        """Every tensor-parallel rank joins, as rank_offset + tp_rank (SGLang's scheduler)."""
        if obj.backend != "gloo":
            raise RuntimeError(f"backend {obj.backend!r} needs CUDA devices (fake: gloo only)")
        if obj.group_name in self.groups:
            raise ValueError(f"group {obj.group_name!r} exists")
        tp = int(self.args.get("tp_size", 1))
        ranks = [obj.rank_offset + tp_rank for tp_rank in range(tp)]
        with ThreadPoolExecutor(tp) as pool:
            self.groups[obj.group_name] = list(pool.map(lambda r: _sglang_group(obj, r), ranks))

    def _receive_group(self, obj: Any) -> dict[str, Any]:
        """Every rank receives every tensor (posted at once, then waited); the weights change
        only once all arrived."""
        groups = self.groups[obj.group_name]
        with ThreadPoolExecutor(len(groups)) as pool:
            per_rank = list(pool.map(lambda g: _receive(g, obj), groups))
        for other in per_rank[1:]:  # tensor-parallel ranks hold the same broadcast
            assert all(torch.equal(other[n], per_rank[0][n]) for n in obj.names)
        return per_rank[0]

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """`Engine.update_weights_from_tensor`: every runner, no weight_version."""
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=self._serialize_tensors_per_rank(named_tensors, load_format),
            load_format=load_format,
            flush_cache=flush_cache,
        )
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj))

    def update_weights_from_disk(self, model_path, load_format=None):
        """`Engine.update_weights_from_disk`: every runner, no weight_version."""
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_disk(obj))

    def _serialize_tensors_per_rank(self, tensors: Any, load_format: str | None) -> list[Any]:
        return [list(tensors)]

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        assert not self.tokenizer_manager.rid_to_state, "release while requests run"
        self.released = True
        self.memory_calls.append("release")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.released = False
        self.memory_calls.append("resume")

    def shutdown(self) -> None:
        self.closed = True
        self.tokenizer_manager.rid_to_state.clear()
        if self.tokenizer_manager.event_loop is not None and self.saved_sigterm is not None:
            self.loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self.saved_sigterm)
        self._log("shutdown")


class Group:
    timeout = datetime.timedelta(seconds=60)  # SGLang: torch's default (30 min)


def _sglang_group(obj: Any, rank: int) -> Any:
    """One rank of a weight-update group, with the store keys SGLang's group has: its
    `init_custom_process_group` wraps the rendezvous store in PrefixStore(group_name), and
    torch's group helper adds "<group_name>/" and the backend's device ("cpu/" for gloo)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        obj.master_address, obj.master_port, obj.world_size, False, timeout=Group.timeout
    )
    name = obj.group_name
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    return dist.ProcessGroupGloo(keys, rank, obj.world_size, Group.timeout)


def _receive(group: Any, obj: Any) -> dict[str, Any]:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0  # SGLang: src=0, the trainer
    tensors = {
        n: torch.empty(shape, dtype=getattr(torch, dtype))
        for n, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes, strict=True)
    }
    works = [group.broadcast([t], opts) for t in tensors.values()]
    for w in works:
        w.wait()
    return tensors


def factory(args: dict[str, Any]) -> SglangEngineAdapter:
    """The `EngineFactory` the tests name on the worker's command line: the real adapter
    over a fake engine."""
    return SglangEngineAdapter(FakeEngine(**args), io_struct, args)
