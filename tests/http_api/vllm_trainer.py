"""A trainer process that hosts its weight group the plain torch way, as a CPU trainer would
for vLLM's weight transfer: `init_process_group("gloo", "tcp://...")` as rank 0, then one
`broadcast` per tensor in the order each /update_weights call names them. Writes the tensors
it sent to OUT.

usage: python vllm_trainer.py MODEL_DIR PORT OUT BUCKETS_JSON
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def main(model_dir: str, port: int, out: str, buckets: list[list[str]]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    weights = load_file(f"{model_dir}/model.safetensors")
    torch.manual_seed(1)
    sent = {}
    for bucket in buckets:
        for name in bucket:
            t = (weights[name] + 0.01 * torch.randn_like(weights[name])).to(torch.bfloat16)
            dist.broadcast(t, src=0)
            sent[name] = t.to(weights[name].dtype)
    save_file(sent, out)
    dist.destroy_process_group()
    print("sent", len(sent), flush=True)


if __name__ == "__main__":
    a = sys.argv
    main(a[1], int(a[2]), a[3], json.loads(a[4]))
