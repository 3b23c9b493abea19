"""Sampled output through a real daemon follows the policy's law over whole sequences: with
speculative decoding adaptive (n-gram drafts, and history drafts from a prompt's earlier
answers read from the store) and across a policy update, every output token passes both tests
of examples/sampling_law.py (the randomized PIT's KS test and the surprise score) under the
weights the sample reports.

The engine tests check the first tokens' joint law exactly (tests/engine/
test_engine_distribution.py); this checks every position of every sample, on the daemon's
paths: workers, the store's history, a policy version switch. The request seeds and the PITs'
draws are fixed; which drafts the workers tried depends on timing, so the samples vary a
little between runs. A correct sampler fails each test (p > 1e-3) with probability 0.1% per
run, and the same tests reject the right samples scored under a law 10% sharper or under the
other version at p < 1e-6 (the surprise score: 7 standard deviations at 10%).
"""

from __future__ import annotations

import pytest
import torch

from examples.sampling_law import check, token_law
from tests.api.support import make_settings
from tests.engine.helpers import make_checkpoint
from tests.rollout.support import InProcessDaemon
from tltd_clients import RolloutClient

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [7, 7, 6, 5, 4, 4, 3], [2, 4, 6, 0, 2, 4], [5, 1, 5]]
N, NEW_TOKENS = 16, 40


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _law(model, samples, gen: torch.Generator, temperature: float = 1.0):
    pairs = [(PROMPTS[s.prompt_index], s.token_ids) for s in samples]
    return token_law(model, pairs, gen, temperature=temperature)


@pytest.fixture
def daemon(sqlite_store, tmp_path):
    """Speculation on every step (the fixed gate): the measured gate turns it off on a loaded
    machine, where a draft does not pay."""
    settings = make_settings(tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
                             worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
                             spec_gate="threshold", drafter_training=False)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        yield d
    finally:
        d.kill()


def test_sampled_tokens_follow_the_law_of_the_reported_policy(daemon, tmp_path):
    # A small vocabulary and peaked logits: drafts are often accepted, so most tokens pass
    # through the speculative paths (accept, residual, bonus).
    kw = dict(vocab=8, hidden=32, heads=2, kv_heads=1, logit_scale=3.0)
    v0 = make_checkpoint(tmp_path / "v0", "llama", seed=5, **kw)
    v1 = make_checkpoint(tmp_path / "v1", "llama", seed=6, **kw)
    d = daemon
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
    assert accepted > tokens // 4, (accepted, tokens)  # over half in runs here
    assert {"ngram", "history"} <= drafters, drafters

    m0, m1 = _model(v0), _model(v1)
    gen = torch.Generator().manual_seed(0)  # the PITs' own draws
    law = _law(m0, by_version[0], gen)
    law += _law(m1, by_version[1], gen)
    right = check(law)
    assert right.tokens == tokens
    assert right.ks_pvalue > 1e-3 and right.z_pvalue > 1e-3, right
    # The tests have the power to see a wrong law: the same samples under a law 10% sharper
    # (temperature 0.9), and v1's samples under v0.
    sharper = check(_law(m0, by_version[0], gen, temperature=0.9))
    assert sharper.z_pvalue < 1e-6, sharper
    wrong = check(_law(m0, by_version[1], gen))
    assert wrong.ks_pvalue < 1e-6 and wrong.z_pvalue < 1e-6, wrong
    print(
        f"\nlaw: {right}\nat temperature 0.9: {sharper}\nv1's samples under v0: {wrong}\n"
        f"accepted drafts {accepted}/{tokens}"
    )
