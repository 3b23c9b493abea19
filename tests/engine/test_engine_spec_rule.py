"""The accept rule on hand-made distributions: it emits plain decoding's tokens, whatever the
drafts, and keeps a draft with the probability the module docstring states."""

from __future__ import annotations

import torch

from tltd_workers.engine.sampling import sample_from
from tltd_workers.engine.spec import accept_drafts


def _rule(p, draft, greedy=False, us=None, dlen=None):
    p = torch.tensor(p, dtype=torch.float64)[None]
    draft = torch.tensor(draft, dtype=torch.long)[None]
    k = draft.shape[1]
    us = torch.tensor(us if us is not None else [0.5] * (k + 1), dtype=torch.float64)[None]
    dl = torch.tensor([k if dlen is None else dlen])
    n, nxt = accept_drafts(p, draft, dl, torch.tensor([greedy]), us)
    return int(n), int(nxt)


P = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]


def test_a_draft_is_kept_when_plain_decoding_draws_it_and_the_draw_follows():
    # Position 0's cdf: token 0 below 0.5, token 1 below 0.8, token 2 above.
    assert _rule(P, [1], us=[0.6, 0.95]) == (1, 2)  # drawn 1 = draft: kept; then p[1] at 0.95
    assert _rule(P, [1], us=[0.6, 0.05]) == (1, 0)
    assert _rule(P, [1], us=[0.1, 0.95]) == (0, 0)  # drawn 0: the draft goes, 0 is emitted
    assert _rule(P, [1], us=[0.9, 0.05]) == (0, 2)
    assert _rule(P + [[1.0, 0.0, 0.0]], [1, 2], us=[0.6, 0.95, 0.3]) == (2, 0)  # both kept
    assert _rule(P + [[1.0, 0.0, 0.0]], [1, 0], us=[0.6, 0.3, 0.7]) == (1, 2)  # 0 vs drawn 2


def test_emitted_tokens_are_plain_decodings_whatever_the_drafts():
    """Random chains of distributions, drafts and uniforms: the row emits the tokens plain
    decoding draws with the same uniforms, up to the first draft that differs."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 500, 4, 6
    p = torch.rand(b, k + 1, v, generator=g, dtype=torch.float64) ** 3
    p /= p.sum(-1, keepdim=True)
    us = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    plain = sample_from(p.reshape(-1, v), us.reshape(-1)).view(b, k + 1)
    # Drafts: plain's own tokens with some replaced, so every number of kept drafts occurs.
    draft = plain[:, :k].clone()
    wrong = torch.rand(b, k, generator=g) < 0.3
    draft[wrong] = torch.randint(0, v, (int(wrong.sum()),), generator=g)
    dlen = torch.randint(0, k + 1, (b,), generator=g)
    n, nxt = accept_drafts(p, draft, dlen, torch.zeros(b, dtype=torch.bool), us)
    for i in range(b):
        emitted = draft[i, : n[i]].tolist() + [int(nxt[i])]
        assert emitted == plain[i, : n[i] + 1].tolist(), i
        same = (draft[i, : dlen[i]] == plain[i, : dlen[i]]).long().cumprod(0).sum()
        assert n[i] == same  # every leading draft that equals plain's token is kept
    assert set(n.tolist()) == set(range(k + 1))


def test_a_fixed_draft_is_kept_with_probability_p_of_it_and_the_law_is_p():
    """Over a fine grid of uniforms: a draft chosen without the uniform is kept with
    probability p(draft), and the emitted token's law is p."""
    grid = 10_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    for x in range(3):
        n, nxt = accept_drafts(
            p.expand(grid, 2, 3),
            torch.full((grid, 1), x),
            torch.ones(grid, dtype=torch.long),
            torch.zeros(grid, dtype=torch.bool),
            torch.stack([u, torch.full_like(u, 0.5)], 1),
        )
        assert abs(float(n.double().mean()) - float(p[0, x])) < 1e-3
        first = torch.where(n >= 1, torch.full_like(nxt, x), nxt)
        law = torch.bincount(first, minlength=3).double() / grid
        assert torch.allclose(law, p[0], atol=1e-3), (x, law)


def test_a_draft_drawn_from_q_with_the_same_uniform_is_kept_where_the_draws_agree():
    """EAGLE's sampled drafts: drawn from q by inverse cdf with the uniform plain decoding
    uses, a draft is kept with probability the overlap of the two laws' cdf intervals (1 for
    q = p; the standard rule's sum of min(p, q) when the laws differ little, less when mass
    moves across tokens), and the emitted token is p's draw either way."""
    grid = 10_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    cases = [
        ([0.5, 0.3, 0.2], [0.5, 0.3, 0.2], 1.0),
        ([0.5, 0.3, 0.2], [0.4, 0.4, 0.2], 0.9),  # = sum of min(p, q)
        ([0.5, 0.5, 0.0], [0.0, 0.5, 0.5], 0.0),  # sum of min(p, q) is 0.5 here
    ]
    for p, q, overlap in cases:
        p, q = (torch.tensor(x, dtype=torch.float64) for x in (p, q))
        draft = sample_from(q.expand(grid, 3), u)[:, None]
        pp = torch.stack([p, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)])
        n, nxt = accept_drafts(
            pp.expand(grid, 2, 3),
            draft,
            torch.ones(grid, dtype=torch.long),
            torch.zeros(grid, dtype=torch.bool),
            torch.stack([u, u], 1),
        )
        assert abs(float(n.double().mean()) - overlap) < 1e-3
        first = torch.where(n >= 1, draft[:, 0], nxt)
        assert torch.equal(first, sample_from(p.expand(grid, 3), u))


def test_greedy_accepts_while_draft_is_argmax():
    p = [[0.1, 0.9, 0.0], [0.2, 0.1, 0.7], [0.6, 0.3, 0.1]]
    assert _rule(p, [1, 2], greedy=True) == (2, 0)
    assert _rule(p, [1, 0], greedy=True) == (1, 2)
    assert _rule(p, [0, 2], greedy=True) == (0, 1)
    assert _rule(p, [1, 2], greedy=True, dlen=1) == (1, 2)  # padding past draft_len ignored


def test_no_drafts_is_plain_sampling():
    assert _rule([[0.2, 0.8]], [], us=[0.1]) == (0, 0)
    assert _rule([[0.2, 0.8]], [], us=[0.3]) == (0, 1)


def test_greedy_takes_the_argmax_of_the_logprobs_not_of_their_exp():
    """Plain greedy decoding takes the argmax of the logprobs; two logprobs one float32 step
    apart can have the same exp, and p.argmax would then pick the lower id, not the token
    plain decoding picks. The engine passes the logprobs' argmax."""
    a = torch.tensor(-0.6931472, dtype=torch.float32)
    lp = torch.stack([a, torch.nextafter(a, torch.tensor(0.0))])
    logp = torch.stack([lp, lp])[None]  # [1, K+1 = 2, V = 2]
    p = logp.exp()
    assert p[0, 0, 0] == p[0, 0, 1] and int(lp.argmax()) == 1  # the tie exp makes
    greedy, u = torch.tensor([True]), torch.full((1, 2), 0.5)
    n, nxt = accept_drafts(p, torch.tensor([[0]]), torch.tensor([1]), greedy, u, logp.argmax(-1))
    assert (int(n), int(nxt)) == (0, 1)  # draft 0 is not the greedy token; 1 is emitted
    n, nxt = accept_drafts(p, torch.tensor([[1]]), torch.tensor([1]), greedy, u, logp.argmax(-1))
    assert (int(n), int(nxt)) == (1, 1)
