"""Truncation filters with exact support sets (docs/architecture.md#sampling-pipeline), as batched tensor ops
on logits.

Each filter masks (to -inf) the tokens outside its support and leaves the rest unchanged; the following
softmax renormalises. Rows are filtered only where their parameter is active. Ties are broken by token id
(lower id first) everywhere: sorts are stable over the vocabulary order.

- top-k: the k largest logits, ties at the boundary by (-logit, token id).
- top-p: by probability descending, the smallest prefix whose mass reaches p; the boundary token stays.
- min-p: p_i >= min_p * p_max, i.e. z_i >= z_max + T log(min_p) on the temperature-scaled logits.
- typical: by |-log p_i - H(p)| ascending, the smallest prefix whose mass reaches typical_p.
A prefix "reaches" a mass when it is within ``MASS_TOLERANCE`` of it, so a boundary that is exact in real
arithmetic (0.30 + 0.33 = 0.63) is not lost to float rounding.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
MASS_TOLERANCE = 1e-6


def _rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero(as_tuple=True)[0]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``min_p`` [N] (0 = off); logits are already temperature-scaled."""
    rows = _rows(min_p > 0)
    if rows.numel():
        sub = logits.index_select(0, rows)
        probs = sub.softmax(dim=-1)
        keep = probs >= min_p.index_select(0, rows).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits.index_copy_(0, rows, sub.masked_fill(~keep, NEG_INF))
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``top_k`` [N] (<= 0 or >= vocab = off). No sort: the k-th largest value comes from ``topk``; every
    larger logit stays, and of the logits equal to it the lowest ids fill the remaining places."""
    vocab = logits.shape[-1]
    rows = _rows((top_k > 0) & (top_k < vocab))
    if rows.numel():
        sub = logits.index_select(0, rows)
        k = top_k.index_select(0, rows).unsqueeze(1)
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        keep = sub >= kth
        excess = keep.sum(dim=-1) > k.squeeze(1)  # ties at the k-th value: more candidates than places
        if bool(excess.any()):
            tied = excess.nonzero(as_tuple=True)[0]
            t_sub, t_kth, t_k = sub[tied], kth[tied], k[tied]
            greater, ties = t_sub > t_kth, t_sub == t_kth
            free = t_k - greater.sum(dim=-1, keepdim=True)
            keep[tied] = greater | (ties & (ties.cumsum(dim=-1) <= free))
        logits.index_copy_(0, rows, sub.masked_fill(~keep, NEG_INF))
    return logits


def reference_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``apply_top_k`` by a full stable sort: the plain definition the tests compare against."""
    vocab = logits.shape[-1]
    rows = _rows((top_k > 0) & (top_k < vocab))
    if rows.numel():
        sub = logits.index_select(0, rows)
        _, order = sub.sort(dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(
            1, order, torch.arange(vocab, device=logits.device).expand_as(order)
        )
        keep = ranks < top_k.index_select(0, rows).unsqueeze(1)
        logits.index_copy_(0, rows, sub.masked_fill(~keep, NEG_INF))
    return logits


def _keep_prefix_reaching(
    sub: torch.Tensor, probs_sorted: torch.Tensor, order: torch.Tensor, mass: torch.Tensor
) -> torch.Tensor:
    """Mask ``sub`` to the shortest prefix (in ``order``) whose probability mass reaches ``mass``."""
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    keep_sorted = mass_before < mass.unsqueeze(1) - MASS_TOLERANCE
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return sub.masked_fill(~keep, NEG_INF)


# candidate counts tried before a full sort: a nucleus is usually far smaller than the vocabulary
_TOP_P_CANDIDATES = (64, 1024)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p`` [N] (1 = off).

    Sorting a 50k vocabulary per row costs far more than the rest of sampling, so each row is first tried
    on its ``topk`` candidates, re-ordered by (probability desc, id). That answer is the full sort's
    whenever every kept token is strictly more likely than the least likely candidate: then the kept
    tokens and every token before them in the global order are among the candidates. Rows where that
    does not hold (flat distributions) try more candidates, then the full sort."""
    rows = _rows(top_p < 1.0)
    if not rows.numel():
        return logits
    vocab = logits.shape[-1]
    sub = logits.index_select(0, rows)
    probs = sub.softmax(dim=-1)
    mass = top_p.index_select(0, rows)
    keep = torch.zeros_like(sub, dtype=torch.bool)
    todo = torch.arange(rows.numel(), device=logits.device)
    for count in _TOP_P_CANDIDATES:
        if count >= vocab or not todo.numel():
            break
        values, ids = probs.index_select(0, todo).topk(count, dim=-1)
        by_id = ids.sort(dim=-1, stable=True)  # ties in id order, then by probability, stably
        values = values.gather(1, by_id.indices)
        values, order = values.sort(dim=-1, descending=True, stable=True)
        ids = by_id.values.gather(1, order)
        kept = (values.cumsum(dim=-1) - values) < mass.index_select(0, todo).unsqueeze(1) - MASS_TOLERANCE
        exact = (kept & (values > values[:, -1:])).sum(dim=-1) == kept.sum(dim=-1)
        done = todo[exact]
        keep[done] = torch.zeros_like(keep[done]).scatter_(1, ids[exact], kept[exact])
        todo = todo[~exact]
    if todo.numel():
        probs_sorted, order = probs.index_select(0, todo).sort(dim=-1, descending=True, stable=True)
        keep[todo] = torch.isfinite(
            _keep_prefix_reaching(sub.index_select(0, todo), probs_sorted, order, mass.index_select(0, todo))
        )
    logits.index_copy_(0, rows, sub.masked_fill(~keep, NEG_INF))
    return logits


def reference_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``apply_top_p`` by a full stable sort: the plain definition the tests compare against."""
    rows = _rows(top_p < 1.0)
    if rows.numel():
        sub = logits.index_select(0, rows)
        probs = sub.softmax(dim=-1)
        probs_sorted, order = probs.sort(dim=-1, descending=True, stable=True)
        logits.index_copy_(
            0, rows, _keep_prefix_reaching(sub, probs_sorted, order, top_p.index_select(0, rows))
        )
    return logits


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """``typical_p`` [N] (1 = off): locally typical sampling (Meister et al.)."""
    rows = _rows(typical_p < 1.0)
    if rows.numel():
        sub = logits.index_select(0, rows)
        logp = sub.log_softmax(dim=-1)
        probs = logp.exp()
        entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)
        surprise_gap = (-logp - entropy).abs()  # +inf for tokens already masked out
        gap_sorted, order = surprise_gap.sort(dim=-1, stable=True)
        del gap_sorted
        probs_sorted = probs.gather(1, order)
        logits.index_copy_(
            0, rows, _keep_prefix_reaching(sub, probs_sorted, order, typical_p.index_select(0, rows))
        )
    return logits


def support(logits: torch.Tensor) -> set[int]:
    """Token ids with a finite logit (test and debugging helper for one row)."""
    return set(torch.isfinite(logits).nonzero(as_tuple=True)[0].tolist())
