"""The EAGLE training objective and the alignment of rollout data to drafter inputs.

For a sample x_0..x_{T-1} with target features h_0..h_{T-1} (h_t is the target's last-layer
hidden state after reading x_t; lm_head(h_t) predicts x_{t+1}), the drafter reads
[h_t ; emb(x_{t+1})] at position t and must predict the next feature h_{t+1} (and through the
shared lm_head, the target's distribution over x_{t+2}). At decode time the first drafter call
reads the last prompt feature h_{s-1} with the first response token x_s, so positions
t >= response_start - 1 are the ones that matter: the loss covers exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CE_WEIGHT = 0.1  # EAGLE: SmoothL1 on features + 0.1 x cross-entropy on the distribution


@dataclass(frozen=True)
class EagleExample:
    hidden_in: torch.Tensor  # [L, H]  h_t
    next_ids: torch.Tensor  # [L]  x_{t+1}
    hidden_target: torch.Tensor  # [L, H]  h_{t+1}
    loss_mask: torch.Tensor  # [L] bool: response positions


def align(token_ids: torch.Tensor, hidden: torch.Tensor, response_start: int) -> EagleExample:
    """Turn one sample (T tokens, T features) into T-1 drafter training positions."""
    if hidden.shape[0] != token_ids.shape[0]:
        raise ValueError("one feature per token expected")
    token_ids = token_ids.to(hidden.device)  # the features' device is where training runs
    t = torch.arange(token_ids.shape[0] - 1, device=hidden.device)
    return EagleExample(
        hidden_in=hidden[:-1],
        next_ids=token_ids[1:],
        hidden_target=hidden[1:],
        loss_mask=t >= response_start - 1,
    )


def eagle_loss(
    pred_hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    pred_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SmoothL1(pred feature, target feature) + 0.1 * CE(target distribution, drafter logits).

    All inputs are flattened over positions ([N, H], [N, V], mask [N]); the mean is taken over
    masked (response) positions only, so prompt tokens never contribute.
    """
    m = mask.to(pred_hidden.dtype)
    count = m.sum().clamp_min(1.0)
    reg = (F.smooth_l1_loss(pred_hidden, target_hidden, reduction="none").mean(-1) * m).sum()
    target_p = torch.softmax(target_logits.float(), dim=-1)
    ce = -(target_p * torch.log_softmax(pred_logits.float(), dim=-1)).sum(-1)
    ce = (ce * m).sum()
    loss = (reg + CE_WEIGHT * ce) / count
    with torch.no_grad():
        top1 = (pred_logits.argmax(-1) == target_logits.argmax(-1)).float()
        parts = {
            "reg": float(reg / count),
            "ce": float(ce / count),
            "top1": float((top1 * m).sum() / count),
            "positions": float(count),
        }
    return loss, parts
