"""The SGLang contract tests: the adapter checked against the real sglang package.

They run in their own environment (`make test-sglang`: the CPU torch build, sglang installed
with --no-deps, see scripts/sglang_contract_env.sh), which sets TLTD_SGLANG_CONTRACT=1 and
passes --confcutdir so that the suite's conftest (database fixtures) is not loaded. The normal
suite does not collect them; where they are collected, a missing sglang is an error.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

if os.environ.get("TLTD_SGLANG_CONTRACT") != "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A tiny real Qwen2 checkpoint (transformers)."""
    from tests.drafter.helpers import make_target_dir

    return make_target_dir(tmp_path_factory.mktemp("target") / "qwen2", seed=3)


@pytest.fixture(scope="session")
def eagle_dir(target_dir, tmp_path_factory) -> Path:
    """The project's drafter exported as an SGLang EAGLE checkpoint, as the worker does."""
    from tests.drafter.helpers import load_target
    from tltd_workers.drafter.versions import export_sglang
    from tltd_workers.engine.eagle import EagleDrafter

    root = tmp_path_factory.mktemp("drafter")
    EagleDrafter.random_init(load_target(target_dir), seed=1).save_pretrained(root / "ours")
    export_sglang(root / "ours", target_dir, root / "eagle", include_embeddings=False)
    return root / "eagle"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# No GPU here: resolution and model construction run with these two settings added to the
# adapter's arguments. Both are the device, nothing else: the adapter leaves the device to
# SGLang's detection, and "triton" is an attention backend SGLang's deterministic mode accepts.
CPU_STAND_IN = {"device": "cpu", "attention_backend": "triton"}


def resolved(args: dict) -> object:
    """`ServerArgs(**args)` resolved as `sglang.Engine` resolves it at start."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**(args | CPU_STAND_IN))
    server_args.resolve_once()
    return server_args


@pytest.fixture(scope="session")
def sglang_process(target_dir, eagle_dir, tmp_path_factory):
    """This process set up as one SGLang scheduler rank on the CPU (config published, a gloo
    group of one), with the resolved arguments of an EAGLE engine on the tiny checkpoint."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state

    from tltd.contract.rollout_messages import EngineSpec
    from tltd_workers.sglang.translate import adaptive_config, engine_args

    spec = EngineSpec(device="cuda:0", max_batch=8, max_seq_len=256, batch_threshold=4)
    adaptive = tmp_path_factory.mktemp("adaptive") / "adaptive.json"
    adaptive.write_text(json.dumps(adaptive_config(spec)))
    args = engine_args(spec, str(target_dir), str(eagle_dir), str(adaptive), 3)
    server_args = resolved(args)
    runtime_context.publish(server_args, role="test", ranks=runtime_context.SpawnRanks(0))
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        backend="gloo",
    )
    parallel_state.initialize_model_parallel(backend="gloo")
    return {"spec": spec, "args": args, "server_args": server_args}
