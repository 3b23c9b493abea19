"""The accept/reject rule on hand-made distributions, and its exactness by enumeration."""

from __future__ import annotations

import itertools

import torch

from tltd_workers.engine.spec import accept_drafts


def _rule(p, draft, q=None, greedy=False, ua=None, us=None, dlen=None):
    p = torch.tensor(p, dtype=torch.float64)[None]
    draft = torch.tensor(draft)[None]
    k = draft.shape[1]
    q = None if q is None else torch.tensor(q, dtype=torch.float64)[None]
    ua = torch.tensor(ua if ua is not None else [0.5] * k, dtype=torch.float64)[None]
    us = torch.tensor(us if us is not None else [0.5] * (k + 1), dtype=torch.float64)[None]
    dl = torch.tensor([k if dlen is None else dlen])
    n, nxt = accept_drafts(p, draft, dl, q, torch.tensor([greedy]), ua, us)
    return int(n), int(nxt)


P = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]


def test_one_hot_q_accepts_with_probability_p_of_the_draft():
    assert _rule(P, [1], ua=[0.29]) == (1, 2)  # 0.29 < p(1) = 0.3: kept; bonus from p[1]
    n, nxt = _rule(P, [1], ua=[0.31], us=[0.0, 0.0])
    assert (n, nxt) == (0, 0)  # rejected; residual = p without token 1 = [5/7, 0, 2/7]
    assert _rule(P, [1], ua=[0.31], us=[0.99, 0.0]) == (0, 2)
    # The rejected token itself is never re-drawn, whatever the uniform.
    for u in torch.linspace(0, 0.999, 50).tolist():
        assert _rule(P, [1], ua=[0.9], us=[u, 0.0])[1] != 1


def test_q_equal_p_always_accepts_and_draws_the_bonus():
    for u in (0.0, 0.5, 0.999):
        n, _ = _rule(P, [0], q=[P[0]], ua=[u])
        assert n == 1


def test_disjoint_support_always_rejects_and_samples_p():
    p = [[0.5, 0.5, 0.0, 0.0], [0.25] * 4]
    q = [[0.0, 0.0, 0.5, 0.5]]
    for u in (0.0, 0.3, 0.7, 0.999):
        n, nxt = _rule(p, [2], q=q, ua=[0.0], us=[u, 0.5])
        assert n == 0 and nxt in (0, 1)


def test_greedy_accepts_while_draft_is_argmax():
    p = [[0.1, 0.9, 0.0], [0.2, 0.1, 0.7], [0.6, 0.3, 0.1]]
    assert _rule(p, [1, 2], greedy=True) == (2, 0)
    assert _rule(p, [1, 0], greedy=True) == (1, 2)
    assert _rule(p, [0, 2], greedy=True) == (0, 1)
    assert _rule(p, [1, 2], greedy=True, dlen=1) == (1, 2)  # padding past draft_len ignored


def test_no_drafts_is_plain_sampling():
    assert _rule([[0.2, 0.8]], torch.zeros(0, dtype=torch.long).tolist(), us=[0.1]) == (0, 0)
    assert _rule([[0.2, 0.8]], torch.zeros(0, dtype=torch.long).tolist(), us=[0.3]) == (0, 1)


def test_rule_is_exact_by_enumerating_uniforms():
    """Integrate over a fine grid of both uniforms: the emitted token's law must equal p.

    Chain of K = 2 sampled drafts with random p, q; we check the first emitted token and the
    second one conditioned on the first draft being kept (independent positions in p).
    """
    g = torch.Generator().manual_seed(0)
    v, grid = 4, 400
    p = torch.rand(3, v, generator=g, dtype=torch.float64) ** 3
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(2, v, generator=g, dtype=torch.float64) ** 3
    q /= q.sum(-1, keepdim=True)
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    law = torch.zeros(v, dtype=torch.float64)
    rows = list(itertools.product(range(v), range(grid), range(grid)))
    x1 = torch.tensor([r[0] for r in rows])
    ua = u[torch.tensor([r[1] for r in rows])]
    us = u[torch.tensor([r[2] for r in rows])]
    b = len(rows)
    draft = torch.stack([x1, torch.zeros(b, dtype=torch.long)], 1)
    n, nxt = accept_drafts(
        p.expand(b, 3, v),
        draft,
        torch.full((b,), 1),
        q.expand(b, 2, v),
        torch.zeros(b, dtype=torch.bool),
        torch.stack([ua, ua], 1),
        torch.stack([us, us, us], 1),
    )
    first = torch.where(n >= 1, x1, nxt)
    weight = q[0, x1] / grid**2  # P(draft = x1) x grid cell mass
    law.index_add_(0, first, weight)
    assert torch.allclose(law, p[0], atol=2e-3), (law, p[0])


def test_greedy_takes_the_argmax_of_the_logprobs_not_of_their_exp():
    """Plain greedy decoding takes the argmax of the logprobs; two logprobs one float32 step
    apart can have the same exp, and p.argmax would then pick the lower id, not the token
    plain decoding picks. The engine passes the logprobs' argmax."""
    a = torch.tensor(-0.6931472, dtype=torch.float32)
    lp = torch.stack([a, torch.nextafter(a, torch.tensor(0.0))])
    logp = torch.stack([lp, lp])[None]  # [1, K+1 = 2, V = 2]
    p = logp.exp()
    assert p[0, 0, 0] == p[0, 0, 1] and int(lp.argmax()) == 1  # the tie exp makes
    args = (torch.tensor([[0]]), torch.tensor([1]), None, torch.tensor([True]))
    uniform = (torch.full((1, 1), 0.5), torch.full((1, 2), 0.5))
    n, nxt = accept_drafts(p, *args, *uniform, logp.argmax(dim=-1))
    assert (int(n), int(nxt)) == (0, 1)  # draft 0 is not the greedy token; 1 is emitted
    n, nxt = accept_drafts(p, torch.tensor([[1]]), *args[1:], *uniform, logp.argmax(dim=-1))
    assert (int(n), int(nxt)) == (1, 1)
