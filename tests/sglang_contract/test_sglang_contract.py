"""The SGLang adapter against the real sglang package (0.5.23, imported next to the CPU torch).

Nothing here is a copy of SGLang: every check builds SGLang's own classes from what the
adapter produces (engine arguments, sampling params, requests, weight-update requests, the
EAGLE export) or binds the adapter's calls to SGLang's own signatures. What only a GPU can
show (kernels, CUDA graphs, memory) is left to docs/backends.md's GPU checklist.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import tomllib
from array import array
from dataclasses import fields, replace
from pathlib import Path

import msgspec
import pytest
import torch
from packaging.requirements import Requirement
from safetensors.torch import load_file

from tests.sglang_contract.conftest import resolved
from tltd.contract.rollout_messages import EngineSpec, JoinBroadcast
from tltd.domain import SamplingParams as OurSamplingParams
from tltd_workers.sglang import engine as adapter_engine
from tltd_workers.sglang.translate import (
    DistributedJoin,
    adaptive_config,
    distributed_join,
    engine_args,
    read_output,
    sampling_params,
    stopped_outside,
)

ROOT = Path(__file__).resolve().parents[2]
GPU = EngineSpec(device="cuda:0", max_batch=8, max_seq_len=256, seed=7)


def test_it_is_the_real_package():
    import sglang

    assert sglang.__version__ == "0.5.23"
    assert torch.__version__.startswith("2.13.0")  # the CPU build, not what sglang asks for


# ---- engine arguments ----------------------------------------------------------------------

MODES = [
    ("off", "auto", False, False),
    ("adaptive", "auto", False, False),  # no drafter yet: NGRAM
    ("adaptive", "ngram", True, False),
    ("fixed", "eagle", False, False),  # EAGLE only, none yet: plain decoding
    ("adaptive", "auto", True, False),
    ("adaptive", "eagle", True, True),
    ("fixed", "eagle", True, True),
]


@pytest.mark.parametrize("mode, drafter, learned, adaptive", MODES)
def test_server_args_accept_the_engine_args_of_every_mode(
    mode, drafter, learned, adaptive, target_dir, eagle_dir, tmp_path
):
    from sglang.srt.server_args import ServerArgs

    spec = replace(GPU, spec_mode=mode, drafter=drafter, draft_lengths=(2, 6, 4))
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(adaptive_config(spec)))
    args = engine_args(
        spec, str(target_dir), str(eagle_dir) if learned else "", str(path) if adaptive else "", 3
    )
    server_args = ServerArgs(**args)
    for key, value in args.items():
        assert getattr(server_args, key) == value, key


def test_server_args_refuse_an_unknown_key(target_dir):
    """The control: ServerArgs does check the names it is given."""
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(TypeError, match="speculative_bogus"):
        ServerArgs(**engine_args(GPU, str(target_dir)) | {"speculative_bogus": 1})


def test_resolution_on_a_real_checkpoint_with_the_exported_eagle_drafter(
    target_dir, eagle_dir, tmp_path
):
    spec = replace(GPU, spec_mode="adaptive", batch_threshold=4, draft_lengths=(2, 4, 6))
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(adaptive_config(spec)))
    r = resolved(engine_args(spec, str(target_dir), str(eagle_dir), str(path), 3)).resolved_dict()
    assert r["speculative_algorithm"] == "EAGLE"
    assert r["speculative_draft_model_path"] == str(eagle_dir)
    assert (r["speculative_num_steps"], r["speculative_eagle_topk"]) == (6, 1)
    assert r["speculative_num_draft_tokens"] == 7
    assert r["speculative_adaptive"] is True  # SGLang did not switch it off
    assert r["enable_deterministic_inference"] is True and r["sampling_backend"] == "pytorch"
    assert r["skip_tokenizer_init"] is True and r["weight_version"] == "3"
    assert r["enable_memory_saver"] is True and r["enable_weights_cpu_backup"] is True
    assert r["context_length"] == 256 and r["max_running_requests"] == 8
    ngram = resolved(engine_args(spec, str(target_dir), "", str(path), 3)).resolved_dict()
    assert ngram["speculative_algorithm"] == "NGRAM"


def test_the_adaptive_config_routes_batch_sizes_as_the_job_gate(tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import (
        AdaptiveSpeculativeParams,
        resolve_candidate_steps_from_config,
    )

    spec = replace(GPU, spec_mode="adaptive", batch_threshold=16, draft_lengths=(2, 4, 6))
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(adaptive_config(spec)))
    assert resolve_candidate_steps_from_config(str(path)) == [0, 2, 4, 6]
    params = AdaptiveSpeculativeParams(initial_steps=6, cfg_path=str(path))
    assert [params.get_steps_for_batch(b) for b in (1, 8, 16)] == [6, 6, 6]
    assert [params.get_steps_for_batch(b) for b in (17, 64)] == [0, 0]  # SD off above


# ---- requests --------------------------------------------------------------------------------


def _ours(**kw) -> OurSamplingParams:
    return OurSamplingParams(**({"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8} | kw))


@pytest.mark.parametrize(
    "ours",
    [
        _ours(stop_token_ids=(5, 3), seed=11),
        _ours(top_k=20, temperature=0.0),
        _ours(seed=None),
    ],
)
def test_sampling_params_verify(ours):
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = sampling_params(ours, max_new_tokens=8, seed=ours.seed)
    sp = SamplingParams(**params)
    sp.normalize(None)
    sp.verify(vocab_size=48)
    assert sp.stop_token_ids == (set(ours.stop_token_ids) or None)
    assert sp.ignore_eos is (not ours.stop_token_ids)
    assert sp.sampling_seed == ours.seed and sp.max_new_tokens == 8


def test_sampling_params_verify_refuses_what_the_fake_refuses():
    from sglang.srt.sampling.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(**sampling_params(_ours(top_p=0.0), max_new_tokens=4, seed=1)).verify(48)


def test_generate_req_input_normalizes_the_adapters_request():
    from sglang.srt.managers.io_struct import GenerateReqInput

    params = sampling_params(_ours(stop_token_ids=(3,)), max_new_tokens=8, seed=5)
    req = GenerateReqInput(
        input_ids=[1, 2, 3], sampling_params=params, return_logprob=True, rid="r1"
    )
    req.normalize_batch_and_arguments()
    assert req.is_single and req.rid == "r1" and req.input_ids == [1, 2, 3]
    assert req.sampling_params == params and req.return_logprob is True


def _req(params: dict, eos: set[int] | None = None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**params)
    sp.normalize(None)
    return Req(
        "r", "", array("i", [1, 2, 3]), sp, return_logprob=True, eos_token_ids=eos, vocab_size=48
    )


def _run(req, tokens: list[int]) -> int:
    """Feed `tokens` one decode step at a time; how many were taken when it finished."""
    for i, tok in enumerate(tokens):
        req.output_ids.append(tok)
        req.update_finish_state(1)
        if req.finished():
            return i + 1
    return len(tokens)


def test_a_real_req_stops_on_the_adapters_stop_token(sglang_process):
    params = sampling_params(_ours(stop_token_ids=(9,)), max_new_tokens=20, seed=1)
    req = _req(params)
    assert _run(req, [4, 5, 9, 6, 7]) == 3
    assert type(req.finished_reason).__name__ == "FINISH_MATCHED_TOKEN"
    # ignore_eos (what the adapter sent before) skips the stop ids: to the length.
    req = _req(params | {"ignore_eos": True})
    assert _run(req, [4, 5, 9, 6, 7] * 4) == 20
    assert type(req.finished_reason).__name__ == "FINISH_LENGTH"


def test_a_real_req_also_stops_at_the_models_eos_which_the_worker_continues(sglang_process):
    from tltd_workers.sglang.translate import Segment

    params = sampling_params(_ours(stop_token_ids=(9,)), max_new_tokens=20, seed=1)
    req = _req(params, eos={7})
    assert _run(req, [4, 7, 9]) == 2  # SGLang's EOS: the worker must go on
    seg = Segment(tuple(req.output_ids), (0.0, 0.0), "stop")
    assert stopped_outside(seg, (9,))
    # Without stop ids the adapter sends ignore_eos: the EOS does not end it.
    req = _req(sampling_params(_ours(), max_new_tokens=4, seed=1), eos={7})
    assert _run(req, [7, 7, 7, 7, 7]) == 4
    assert type(req.finished_reason).__name__ == "FINISH_LENGTH"


# ---- the calls the adapter makes ------------------------------------------------------------


def _bind(fn, *args, **kwargs) -> None:
    inspect.signature(fn).bind(*args, **kwargs)


def test_the_engine_methods_the_adapter_calls_take_its_arguments():
    from sglang.srt.entrypoints.engine import Engine

    e = object()
    _bind(Engine.async_generate, e, input_ids=[1], sampling_params={}, return_logprob=True, rid="r")
    _bind(Engine.begin_weight_update, e, "draft")
    _bind(Engine.end_weight_update, e)
    _bind(Engine._serialize_tensors_per_rank, e, [("w", torch.zeros(1))], None)
    _bind(Engine.release_memory_occupation, e, tags=adapter_engine.MEMORY_TAGS)
    _bind(Engine.resume_memory_occupation, e, tags=adapter_engine.MEMORY_TAGS)
    _bind(Engine.shutdown, e)
    assert inspect.iscoroutinefunction(Engine.async_generate)
    init = inspect.getsource(Engine.__init__)
    assert "self.loop = " in init and "self.tokenizer_manager = " in init
    # What the adapter no longer relies on: no is_draft_model, no selector, no version here.
    params = inspect.signature(Engine.update_weights_from_tensor).parameters
    assert "is_draft_model" not in params and "selector" not in params


def test_the_tokenizer_manager_methods_the_adapter_calls_take_its_arguments():
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = object()
    _bind(TokenizerManager.abort_request, tm, rid="r")
    _bind(TokenizerManager.abort_request, tm, abort_all=True)
    _bind(TokenizerManager.update_weights_from_tensor, tm, object(), None)
    _bind(TokenizerManager.update_weights_from_disk, tm, object(), None)
    assert inspect.iscoroutinefunction(TokenizerManager.update_weights_from_tensor)
    assert inspect.iscoroutinefunction(TokenizerManager.update_weights_from_disk)
    assert "self.rid_to_state: " in inspect.getsource(TokenizerManager.init_running_status)
    assert "self.signal_handler_class = SignalHandler" in inspect.getsource(TokenizerManager)
    assert "selector" in UpdateWeightsFromTensorReqInput.__struct_fields__


def test_weight_update_requests_are_valid_sglang_requests():
    from sglang.srt.managers import io_struct

    class Engine:  # the one method tensor_update_request takes from the engine
        def _serialize_tensors_per_rank(self, named, load_format):
            return [b"payload"]

    req = adapter_engine.tensor_update_request(
        io_struct, Engine(), [("fc.weight", None)], "draft", "3", False
    )
    # Through msgpack, as SGLang sends it to its scheduler: types and literals are checked.
    back = msgspec.msgpack.decode(
        msgspec.msgpack.encode(req), type=io_struct.UpdateWeightsFromTensorReqInput
    )
    assert (back.selector, back.weight_version, back.flush_cache) == ("draft", "3", False)
    disk = adapter_engine.disk_update_request(io_struct, "/p", "4")
    back = msgspec.msgpack.decode(
        msgspec.msgpack.encode(disk), type=io_struct.UpdateWeightFromDiskReqInput
    )
    assert (back.model_path, back.weight_version) == ("/p", "4")
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(replace_selector(req, "drafter")),
            type=io_struct.UpdateWeightsFromTensorReqInput,
        )


def replace_selector(req, selector: str):
    return msgspec.structs.replace(req, selector=selector)


class _Dispatched:
    """A TokenizerManager stand-in for its own methods: state plus the scheduler socket."""

    def __init__(self):
        self.rid_to_state: dict = {}
        self.sent: list = []
        self.enable_metrics = False

    def _dispatch_to_scheduler(self, req):
        self.sent.append(req)


def test_sglang_drops_the_abort_of_a_rid_it_has_not_registered(sglang_process):
    """Why the adapter keeps such aborts until the rid is registered."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = _Dispatched()
    TokenizerManager.abort_request(tm, rid="unseen")
    assert tm.sent == []
    TokenizerManager.abort_request(tm, abort_all=True)
    assert [(r.rid, r.abort_all) for r in tm.sent] == [("", True)]


def test_the_worker_keeps_sglangs_sigterm_handler_from_draining_the_engine():
    from sglang.srt.managers.tokenizer_manager import SignalHandler, TokenizerManager

    assert "self.signal_handler_class(self)" in inspect.getsource(
        TokenizerManager.auto_create_handle_loop
    )

    class Tm:
        gracefully_exit = False
        signal_handler_class = SignalHandler

    SignalHandler(tm := Tm()).sigterm_handler(15, None)
    assert tm.gracefully_exit  # SGLang's own: starts its exit
    tm = Tm()
    adapter_engine.keep_stop_signals_ignored(tm)
    assert issubclass(tm.signal_handler_class, SignalHandler)
    tm.signal_handler_class(tm).sigterm_handler(15, None)
    assert not tm.gracefully_exit


# ---- outputs -------------------------------------------------------------------------------


def test_spec_metrics_and_weight_versions_in_meta_info_read_back(sglang_process):
    """SGLang's own meta_info builders -> read_output."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.weight_versions import WeightVersionSpan, add_weight_versions_to_meta_info

    class Recv:  # the scheduler's batch output, one request
        spec_verify_ct = [4]
        spec_num_correct_drafts = [4]
        completion_tokens = [9]
        spec_correct_drafts_histogram = [[1, 2, 1]]
        spec_num_cap_tokens = None

    meta = {"finish_reason": {"type": "stop", "matched": 8}}
    meta["output_token_logprobs"] = [(-0.5, t, None) for t in range(9)]
    TokenizerManager._calculate_spec_decoding_metrics(object(), meta, Recv(), 0)
    spans = [
        WeightVersionSpan(version="3", start=0, end=5),
        WeightVersionSpan(version="4", start=5, end=9),
    ]
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=9)
    seg = read_output({"output_ids": list(range(9)), "meta_info": meta})
    assert (seg.spec_steps, seg.accepted, seg.plain_steps) == (4, 4, 1)
    assert seg.drafted == 4 * 6  # verify passes x (num_draft_tokens - 1) of the engine
    assert seg.accepted_lengths == ((1, 1), (2, 2), (3, 1))
    assert meta["weight_version"] == "4" and seg.weight_version == "3"  # the first span


# ---- the EAGLE export against SGLang's EAGLE model ------------------------------------------


def _eagle_model(eagle_dir: Path, arch: str):
    """SGLang's EAGLE draft model class, built on the CPU from the export's config."""
    import sglang.srt.layers.rotary_embedding.base as rope
    from transformers import AutoConfig

    rope._is_cpu = True  # the rotary kernels are picked per device; only names matter here
    module = {"Qwen2ForCausalLMEagle": "qwen2_eagle", "LlamaForCausalLMEagle": "llama_eagle"}
    cls = getattr(__import__(f"sglang.srt.models.{module[arch]}", fromlist=[arch]), arch)
    return cls(AutoConfig.from_pretrained(eagle_dir))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_eagle_export_loads_into_every_parameter_of_sglangs_eagle_model(
    family, eagle_dir, sglang_process, tmp_path
):
    from tests.drafter.helpers import load_target
    from tests.drafter.test_versions import _llama_target_dir
    from tltd_workers.drafter.versions import export_sglang
    from tltd_workers.engine.eagle import EagleDrafter

    if family == "llama":
        target = _llama_target_dir(tmp_path / "llama")
        EagleDrafter.random_init(load_target(target), seed=2).save_pretrained(tmp_path / "ours")
        export_sglang(tmp_path / "ours", target, tmp_path / "eagle")
        eagle_dir = tmp_path / "eagle"
    cfg = json.loads((eagle_dir / "config.json").read_text())
    (arch,) = cfg["architectures"]
    model = _eagle_model(eagle_dir, arch)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    tensors = load_file(str(eagle_dir / "model.safetensors"))
    # What the worker sends as a draft update; the embeddings are the target's in SGLang.
    named = [(k, v) for k, v in tensors.items() if k not in ("embed_tokens.weight",)]
    model.load_weights(named)
    params = dict(model.named_parameters())
    # The embeddings and the head are the target's: SGLang's EAGLE worker hands them over
    # (`set_embed_and_head`) when it starts.
    shared = {"model.embed_tokens.weight", "lm_head.weight"} & params.keys()
    assert "set_embed_and_head" in dir(model)
    unset = {n for n, p in params.items() if torch.isnan(p).any()}
    assert unset == shared
    loaded = sum(p.numel() for n, p in params.items() if n not in shared)
    assert loaded == sum(v.numel() for _, v in named)  # every exported tensor landed once
    assert torch.equal(
        params["model.fc.weight"], tensors["fc.weight"].to(params["model.fc.weight"])
    )


# ---- packaging -------------------------------------------------------------------------------


def test_the_sglang_extra_installs_next_to_what_sglang_requires():
    """`pip install -e ".[sglang]"` (and with the torch extra) resolves with the torch and
    transformers sglang pins, and brings what the SGLang worker imports."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = {}
    for line in importlib.metadata.requires("sglang") or []:
        req = Requirement(line)
        if req.marker is None and str(req.specifier).startswith("=="):
            pins[req.name.lower()] = str(req.specifier)[2:]
    assert {"torch", "transformers"} <= pins.keys()
    ours = [Requirement(r) for r in project["dependencies"] + extras["sglang"] + extras["torch"]]
    for req in ours:
        if req.name.lower() in pins:
            assert req.specifier.contains(pins[req.name.lower()]), (req, pins[req.name.lower()])
    sglang_extra = {Requirement(r).name.lower() for r in extras["sglang"]}
    assert {"sglang", "safetensors"} <= sglang_extra
    assert any(
        Requirement(r).specifier.contains(importlib.metadata.version("sglang"))
        for r in extras["sglang"]
        if Requirement(r).name == "sglang"
    )


def test_asyncio_loop_of_the_adapter_is_what_sglang_uses():
    """The adapter runs SGLang's coroutines on `engine.loop` with run_until_complete."""
    from sglang.srt.entrypoints.engine import Engine

    for method in (Engine.begin_weight_update, Engine.release_memory_occupation):
        assert "self.loop.run_until_complete" in inspect.getsource(method)


# ---- a policy broadcast through SGLang's distributed weight update --------------------------


def _join() -> DistributedJoin:
    return distributed_join(
        JoinBroadcast("/v/1", "127.0.0.1", 29500, "tltd/job/u1", 2, 4,
                      (("w", "BF16", (2, 3)), ("b", "F32", (3,))), 30.0, ranks=1)
    )  # fmt: skip


def test_the_distributed_update_methods_take_the_adapters_arguments():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    j, e, tm = _join(), object(), object()
    _bind(Engine.init_weights_update_group, e, j.address, j.port, j.rank_offset, j.world_size,
          j.group_name, j.backend)  # fmt: skip
    _bind(Engine.update_weights_from_distributed, e, list(j.names), list(j.dtypes),
          [list(s) for s in j.shapes], j.group_name, True)  # fmt: skip
    _bind(Engine.destroy_weights_update_group, e, j.group_name)
    for name in (
        "init_weights_update_group",
        "update_weights_from_distributed",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
    ):
        method = getattr(TokenizerManager, name)
        assert inspect.iscoroutinefunction(method), name
        _bind(method, tm, object(), None)
    assert inspect.iscoroutinefunction(TokenizerManager.update_weight_version)
    _bind(TokenizerManager.update_weight_version, tm, object())
    # The fake engine the worker tests run has the same Engine methods.
    from tests.rollout.fake_sglang import FakeEngine

    for name in ("init_weights_update_group", "update_weights_from_distributed",
                 "destroy_weights_update_group"):  # fmt: skip
        real = list(inspect.signature(getattr(Engine, name)).parameters)
        assert list(inspect.signature(getattr(FakeEngine, name)).parameters) == real, name


def test_distributed_update_requests_are_valid_sglang_requests():
    from sglang.srt.managers import io_struct

    from tests.rollout import fake_sglang

    j = _join()
    init = adapter_engine.init_group_request(io_struct, j)
    update = adapter_engine.distributed_update_request(io_struct, j)
    version = io_struct.UpdateWeightVersionReqInput(new_version="4", abort_all_requests=False)
    begin = io_struct.BeginWeightUpdateReqInput(selector="target")
    destroy = io_struct.DestroyWeightsUpdateGroupReqInput(group_name=j.group_name)
    for req in (init, update, version, begin, destroy):
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=type(req))
        assert back == req
        # The fake's request classes have SGLang's fields.
        fake = {f.name for f in fields(getattr(fake_sglang.io_struct, type(req).__name__))}
        assert fake == set(type(req).__struct_fields__) - {"rid", "http_worker_ipc"}
    assert (init.rank_offset, init.world_size, init.backend) == (2, 4, "gloo")
    assert update.weight_version is None and update.selector == "target" and update.flush_cache
    assert [getattr(torch, d) for d in update.dtypes] == [torch.bfloat16, torch.float32]
    assert update.shapes == [[2, 3], [3]] and update.names == ["w", "b"]


def test_sglangs_distributed_update_requires_the_session_the_adapter_opens():
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    source = inspect.getsource(SchedulerWeightUpdaterManager.update_weights_from_distributed)
    assert "self._session is None" in source and "record_weight_version_after_update" in source
    # An engine with tensor parallelism takes tp_size consecutive ranks from rank_offset.
    assert "rank = rank_offset + self.tp_rank" in inspect.getsource(
        WeightUpdater.init_weights_update_group
    )


def test_sglangs_own_receive_joins_the_daemons_group_and_gets_every_tensor(sglang_process):
    """The daemon's store and keys, the trainer's rank 0 as the client sends it, the daemon's
    rank 1 as it receives, and SGLang's real WeightUpdater joining at rank_offset 2 with its
    init_custom_process_group and receiving with its own code."""
    import datetime
    import threading
    import types

    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from tltd.contract.broadcast import group_prefix, received_tensors

    wait = datetime.timedelta(seconds=60)
    weights = {"w": torch.randn(2, 3).to(torch.bfloat16), "b": torch.arange(3.0)}
    specs = (("w", "BF16", (2, 3)), ("b", "F32", (3,)))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    group, got = "tltd/job/u1", {}

    def trainer() -> None:
        client = dist.TCPStore("127.0.0.1", store.port, 3, False, timeout=wait)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(group_prefix(group), client), 0, 3, wait)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in weights.values():
            pg.broadcast([t.clone()], opts).wait()

    def daemon() -> None:
        got["daemon"] = dict(received_tensors(store, group_prefix(group), 1, 3, specs, wait))

    threads = [threading.Thread(target=f) for f in (trainer, daemon)]
    for t in threads:
        t.start()
    updater = types.SimpleNamespace(tp_rank=0, _model_update_group={}, device="cpu")
    ok, message = WeightUpdater.init_weights_update_group(
        updater, "127.0.0.1", store.port, 2, 3, group, "gloo"
    )
    assert ok, message
    received = WeightUpdater.receive_weights_from_distributed(
        updater, names=["w", "b"], dtypes=["bfloat16", "float32"], shapes=[[2, 3], [3]],
        group_name=group,
    )  # fmt: skip
    for t in threads:
        t.join(60)
    assert [n for n, _ in received] == ["w", "b"]
    for name, tensor in received:
        assert torch.equal(tensor.view(torch.uint8), weights[name].view(torch.uint8))
        assert torch.equal(got["daemon"][name].view(torch.uint8), weights[name].view(torch.uint8))
    assert WeightUpdater.destroy_weights_update_group(updater, group)[0]
