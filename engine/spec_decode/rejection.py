"""The exact speculative-sampling rule over a batch of drafts (docs/architecture.md#speculative-decoding).

Row ``b`` proposed ``num_draft[b]`` ≤ ``k`` tokens; the target scored them in one forward, giving its
distribution at each drafted position and one more (the bonus position). Sampled rows accept draft token
``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection they draw from
``norm(max(0, p_i - q_i))`` and stop; if every draft is accepted they draw the bonus token from ``p_k``.
The emitted tokens are then distributed exactly as tokens sampled from the target one at a time. A
deterministic proposer (prompt lookup) is the one-hot ``q``: accept with probability ``p_i(x_i)``, and on
rejection draw from ``p_i`` without ``x_i``. Greedy rows keep the longest prefix equal to the target's
argmax, plus the argmax after it.

Every decision takes its uniform number from the caller (a seeded request's own generator), so a seeded run
reproduces whatever else is in the batch. No host syncs: all of it is tensor ops over the batch.
"""

from __future__ import annotations

import torch

from kvpilot.engine.sampling.draw import inverse_cdf_draw

#: marks the positions of a row's output that were not emitted
PAD = -1


def _accepted_prefix(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading drafts were accepted (``accept`` [B, k], counting only real drafts)."""
    k = accept.shape[1]
    real = torch.arange(k, device=accept.device) < num_draft.unsqueeze(1)
    return (accept & real).long().cumprod(dim=1).sum(dim=1)


def _emit(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: the accepted drafts, then ``last``, then :data:`PAD`."""
    batch, k = drafts.shape
    out = torch.full((batch, k + 1), PAD, dtype=torch.long, device=drafts.device)
    positions = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    out[:, :k] = torch.where(positions[:, :k] < accepted.unsqueeze(1), drafts.long(), PAD)
    out.scatter_(1, accepted.unsqueeze(1), last.long().unsqueeze(1))
    return out


def accept_greedy(
    target_argmax: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_argmax`` [B, k + 1], ``drafts`` [B, k] → (tokens [B, k + 1] padded with :data:`PAD`,
    emitted count [B])."""
    k = drafts.shape[1]
    accepted = _accepted_prefix(drafts == target_argmax[:, :k], num_draft)
    last = target_argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return _emit(drafts, accepted, last), accepted + 1


def accept_sampled(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_probs`` [B, k + 1, V] (after the whole sampling pipeline), ``drafts`` [B, k],
    ``draft_probs`` [B, k, V] or None for a deterministic proposer, ``uniforms`` [B, k] for the accept
    tests and ``final_uniforms`` [B] for the one draw → (tokens [B, k + 1] padded, emitted count [B])."""
    batch, k = drafts.shape
    index = drafts.long().clamp(min=0).unsqueeze(2)  # padding drafts read any entry: they are masked
    p_drafted = target_probs[:, :k].gather(2, index).squeeze(2)  # [B, k]
    if draft_probs is None:
        ratio = p_drafted
    else:
        q_drafted = draft_probs.gather(2, index).squeeze(2)
        ratio = p_drafted / q_drafted.clamp(min=torch.finfo(q_drafted.dtype).tiny)
    accepted = _accepted_prefix(uniforms < ratio, num_draft)
    rows = torch.arange(batch, device=drafts.device)
    p_final = target_probs[rows, accepted]  # [B, V]: where the one draw happens
    rejected = accepted < num_draft  # else every draft was accepted: the bonus draw from p_k itself
    if draft_probs is None:
        q_final = torch.zeros_like(p_final)
        rejected_token = drafts.long().gather(1, accepted.clamp(max=k - 1).unsqueeze(1))
        q_final.scatter_(1, rejected_token, 1.0)
    else:
        q_final = draft_probs[rows, accepted.clamp(max=k - 1)]
    residual = torch.where(rejected.unsqueeze(1), (p_final - q_final).clamp(min=0), p_final)
    mass = residual.sum(dim=1, keepdim=True)
    # p = q exactly leaves no residual mass; a rejection then only comes from rounding: draw from p
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_final)
    last = inverse_cdf_draw(residual, final_uniforms)
    return _emit(drafts, accepted, last), accepted + 1
