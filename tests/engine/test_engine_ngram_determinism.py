"""A seeded sample with n-gram drafts does not depend on what else is in the batch."""

from __future__ import annotations

from examples.task import encode_prompt, load_tokenizer, make_dataset
from examples.task.workload import MODEL_DIR
from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig


def _run(prompts: list[list[int]], others: int, max_batch: int) -> dict[int, list[int]]:
    """Prompt 0 (n=4, seeded) behind `others` requests; its samples' tokens by index."""
    e = Engine(
        MODEL_DIR,
        EngineConfig(
            max_batch=max_batch,
            max_seq_len=300,
            spec_mode="fixed",
            strategies=(Strategy("ngram", 3),),
            batch_threshold=64,
            seed=0,
        ),
    )
    for j in range(others):
        sp = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=120, seed=100 + j)
        e.add_request(f"o{j}", prompts[1 + j], sp)
    e.add_request("A", prompts[0], SamplingParams(n=4, temperature=1.0, top_k=20, seed=7))
    out: dict[int, list[int]] = {}
    while e.has_work():
        out.update({o.sample_index: o.token_ids for o in e.step() if o.request_id == "A"})
    return out


def test_seeded_ngram_samples_do_not_depend_on_the_batch():
    # Siblings share n-grams; which sibling's occurrence the index keeps must not follow the
    # slot order, which compaction after other requests' rows finish reshuffles.
    tok = load_tokenizer(MODEL_DIR)
    prompts = [encode_prompt(tok, p.prompt) for p in make_dataset(8, seed=5)]
    alone = _run(prompts, others=0, max_batch=16)
    assert len(alone) == 4
    for others, max_batch in [(5, 8), (3, 16)]:
        assert _run(prompts, others, max_batch) == alone, (others, max_batch)
