"""`examples/grpo_demo.py --quick --http`: the same GRPO step with rollouts through the official
`openai` client and weights pushed to /update_weights_from_disk, against the gRPC run (weights
pushed in-band; the `grpc_demo` run the end-to-end test checks too): the
seeded SD-off samples agree (same lengths, same rewards) and the trainer's recomputed logprobs
agree with the daemon's."""

from __future__ import annotations

import re

import pytest

from tests.demo.support import run_demo


def _off_row(out: str) -> list[str]:
    rows = [line.split() for line in out.splitlines() if line.startswith("off ")]
    return rows[-1]


@pytest.mark.slow
def test_http_run_matches_the_grpc_run(tmp_path, demo_model, grpc_demo):
    over_http = run_demo(demo_model, tmp_path / "http", "--http").out
    over_grpc = grpc_demo.out
    http_row, grpc_row = _off_row(over_http), _off_row(over_grpc)
    # tokens, p50, p99, capped ... reward: the SD-off samples are the same samples.
    assert http_row[8:12] == grpc_row[8:12]
    assert http_row[-1] == grpc_row[-1]  # mean reward
    assert http_row[-5] == "1"  # the last step's samples come from the pushed policy
    for out in (over_http, over_grpc):
        found = re.search(r"daemon logprob\| over the tokens .* rollout tokens\): (\S+)", out)
        gap = float(found.group(1))
        assert gap < 1e-4
        assert "tltd exited with status 0 after SIGTERM" in out
    # The step's checkpoint went in through /update_weights_from_disk.
    assert (tmp_path / "http" / "ckpt-off" / "step-1" / "model.safetensors").exists()
    assert not (grpc_demo.work / "ckpt-off").exists()  # gRPC pushes the weights in-band
