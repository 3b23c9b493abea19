"""Sampled output through a real daemon follows the policy's law over whole sequences: with
speculative decoding adaptive (n-gram drafts, and history drafts from a prompt's earlier
answers read from the store) and across a policy update, the randomized PIT of every output
token (examples/sampling_law.py) is U(0, 1) under the weights the sample reports.

The engine tests check the first tokens' joint law exactly (tests/engine/
test_engine_distribution.py); this checks every position of every sample, on the daemon's
paths: workers, the store's history, a policy version switch. All seeds are fixed, so the
p-values are deterministic; a correct sampler fails p > 1e-3 with probability 0.1% per (fixed)
draw, and the same test rejects the right samples scored under the wrong version at p < 1e-6.
"""

from __future__ import annotations

import torch

from examples.sampling_law import ks_uniform, pit_values
from tests.engine.helpers import make_checkpoint
from tltd_clients import RolloutClient

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [7, 7, 6, 5, 4, 4, 3], [2, 4, 6, 0, 2, 4], [5, 1, 5]]
N, NEW_TOKENS = 16, 40


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _pits(model, samples, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return pit_values(model, [(PROMPTS[s.prompt_index], s.token_ids) for s in samples], gen)


def test_sampled_tokens_follow_the_law_of_the_reported_policy(sqlite_daemon, tmp_path):
    # A small vocabulary and peaked logits: drafts are often accepted, so most tokens pass
    # through the speculative paths (accept, residual, bonus).
    kw = dict(vocab=8, hidden=32, heads=2, kv_heads=1, logit_scale=3.0)
    v0 = make_checkpoint(tmp_path / "v0", "llama", seed=5, **kw)
    v1 = make_checkpoint(tmp_path / "v1", "llama", seed=6, **kw)
    d = sqlite_daemon
    by_version: dict[int, list] = {0: [], 1: []}
    with RolloutClient(d.target) as c:
        c.create_job(v0, job_id="law", speculative="auto", online_training=False)
        d.wait_workers_ready(2)
        # Two epochs on v0 (the second drafts from the first's answers), one after the update.
        for epoch in range(3):
            if epoch == 2:
                assert c.update_policy(v1, note="the next policy") == 1
            got = c.generate(
                PROMPTS, N, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=100 + epoch,
                return_provenance=True,
            )  # fmt: skip
            for s in got:
                by_version[s.policy_version].append(s)
    assert len(by_version[0]) == 2 * N * len(PROMPTS) and len(by_version[1]) == N * len(PROMPTS)
    spec = [s for ss in by_version.values() for s in ss]
    accepted = sum(s.accepted_tokens for s in spec)
    drafters = {p.drafter for s in spec for p in s.provenance if p.source == "accepted"}
    tokens = sum(len(s.token_ids) for s in spec)
    assert accepted > tokens // 4, (accepted, tokens)  # a third or more came from drafts
    assert {"ngram", "history"} <= drafters, drafters

    m0, m1 = _model(v0), _model(v1)
    right = ks_uniform(_pits(m0, by_version[0], 1) + _pits(m1, by_version[1], 2))
    assert right.tokens == tokens
    assert right.pvalue > 1e-3, right
    # The test has the power to see a wrong law: v1's samples scored under v0.
    wrong = ks_uniform(_pits(m0, by_version[1], 3))
    assert wrong.pvalue < 1e-6, wrong
    print(f"\nlaw: {right}; v1's samples under v0: {wrong}; accepted drafts {accepted}/{tokens}")
