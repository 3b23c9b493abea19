"""A trainer process as slime, AReaL and SkyRL run one for SGLang's distributed weight
update: rank 0 of a gloo group it hosts (the TCP store's master, the keys SGLang's
`init_custom_process_group` builds for the group name), broadcasting its policy's tensors in
buckets, in the order the update calls announce them. Writes the tensors it sent to OUT.

usage: python gloo_trainer.py MODEL_DIR PORT GROUP OUT BUCKETS_JSON
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def main(model_dir: str, port: int, group: str, out: str, buckets: list[list[str]]) -> None:
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout)
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group}/", dist.PrefixStore(group, store)))
    pg = dist.ProcessGroupGloo(keys, 0, 2, timeout)
    weights = load_file(f"{model_dir}/model.safetensors")
    torch.manual_seed(0)
    sent = {}
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for bucket in buckets:
        for name in bucket:
            # A training step's worth of change, sent in bf16 as trainers do.
            t = (weights[name] + 0.01 * torch.randn_like(weights[name])).to(torch.bfloat16)
            pg.broadcast([t], opts).wait()
            sent[name] = t.to(weights[name].dtype)
    save_file(sent, out)
    print("sent", len(sent), flush=True)


if __name__ == "__main__":
    a = sys.argv
    main(a[1], int(a[2]), a[3], a[4], json.loads(a[5]))
