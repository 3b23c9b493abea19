"""Runs in the TRL client environment (scripts/trl_client_env.sh), not the project's: TRL's own
VLLMClient against a tltd daemon's HTTP door, unmodified except that its "is vLLM installed"
check, which guards only its CUDA weight path, is bypassed. Prints one JSON object of what
the client returned; the test in the project's environment judges it.

usage: python drive_trl.py BASE_URL PROMPTS_JSON
"""

from __future__ import annotations

import json
import sys

import trl
import trl.generation.vllm_client as vllm_client


def main(url: str, prompts: list[list[int]]) -> dict:
    vllm_client.is_vllm_available = lambda *args, **kwargs: True  # the one bypass
    client = vllm_client.VLLMClient(base_url=url, connection_timeout=30)
    out: dict = {"trl_version": trl.__version__, "model": client.model}
    out["world_size"] = client.get_world_size()
    out["server_info"] = client.get_server_info()
    first = client.generate(
        prompts, n=3, max_tokens=8, temperature=1.0, generation_kwargs={"seed": 7}
    )
    out["first"] = first
    out["again"] = client.generate(
        prompts, n=3, max_tokens=8, temperature=1.0, generation_kwargs={"seed": 7}
    )
    out["other_seed"] = client.generate(
        prompts, n=3, max_tokens=8, temperature=1.0, generation_kwargs={"seed": 8}
    )
    stop = first["completion_ids"][0][3]
    out["stop_id"] = stop
    out["stopped"] = client.generate(
        prompts,
        n=3,
        max_tokens=8,
        temperature=1.0,
        generation_kwargs={"seed": 7, "stop_token_ids": [stop]},
    )
    out["no_logprobs"] = client.generate(prompts[:1], n=1, max_tokens=4, logprobs=None)
    out["top3"] = client.generate(
        prompts, n=1, max_tokens=5, temperature=1.0, logprobs=3, generation_kwargs={"seed": 7}
    )
    # Teacher logprobs of given sequences (prompt logprobs), at TRL's default top_logprobs=100.
    sequences = [p + c for p, c in zip(prompts, first["completion_ids"][::3], strict=True)]
    out["sequences"] = sequences
    out["sequence_logprobs"] = client.get_sequence_logprobs(sequences, [len(p) for p in prompts])
    try:  # TRL's weight path: vLLM's NCCL engine (vLLM's own helpers, a CUDA device)
        client.init_communicator(device="cpu")
        out["init_communicator"] = "joined"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
        out["init_communicator"] = f"{type(exc).__name__}: {exc}"
    client.reset_prefix_cache()
    out["reset"] = True
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
