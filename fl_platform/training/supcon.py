"""Supervised contrastive loss (Khosla et al. 2020), as VHL's reference implements it.

One view per sample, every row is an anchor (``contrast_mode='all'``). For anchor ``a`` with
positives ``P(a)`` (same label, not itself) and contrast set ``A(a)`` (every other row):

    l_a = -(tau / tau_base) * mean_{p in P(a)} log( exp(u_a.u_p / tau) / sum_{q in A(a)} exp(u_a.u_q / tau) )

and the loss is the mean over anchors. An anchor without positives contributes 0 (its
``|P(a)|`` is treated as 1, as in the reference), so the loss is finite for any labels.
"""

from __future__ import annotations

import torch


def supcon_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07,
                base_temperature: float = 0.07) -> torch.Tensor:
    """SupCon over ``features`` ``[N, D]`` (L2-normalise them first) with integer ``labels`` ``[N]``."""
    if features.dim() != 2 or labels.dim() != 1 or features.shape[0] != labels.shape[0]:
        raise ValueError(f"supcon_loss needs features [N, D] and labels [N], got {tuple(features.shape)} "
                         f"and {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"the SupCon temperature must be > 0, got {temperature}")
    n = features.shape[0]
    if n < 2:
        return features.sum() * 0.0
    logits = features @ features.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    not_self = ~torch.eye(n, dtype=torch.bool, device=features.device)
    positives = (labels[:, None] == labels[None, :]) & not_self
    exp_logits = torch.exp(logits) * not_self
    log_prob = logits - torch.log(exp_logits.sum(dim=1, keepdim=True))
    pos = positives.to(log_prob.dtype)
    mean_log_prob_pos = (pos * log_prob).sum(dim=1) / pos.sum(dim=1).clamp_min(1.0)
    return -(temperature / base_temperature) * mean_log_prob_pos.mean()
