"""Truncation filters with exact support sets (docs/architecture.md#sampling-pipeline), as batched tensor ops
on logits.

Each filter masks (to -inf) the tokens outside its support and leaves the rest unchanged; the following
softmax renormalises. Rows are filtered only where their parameter is active. Ties are broken by token id
(lower id first) everywhere: sorts are stable over the vocabulary order.

- top-k: the k largest logits, ties at the boundary by (-logit, token id).
- top-p: by probability descending, the smallest prefix whose mass reaches p; the boundary token stays
  (and the first token, however small p is).
- min-p: p_i >= min_p * p_max, i.e. z_i >= z_max + T log(min_p) on the temperature-scaled logits.
- typical: by |-log p_i - H(p)| ascending, the smallest prefix whose mass reaches typical_p.
A prefix "reaches" a mass when it is within ``MASS_TOLERANCE`` of it, so a boundary that is exact in real
arithmetic (0.30 + 0.33 = 0.63) is not lost to float rounding.

Which rows a filter works on comes from the caller (``rows``: host-built indices, or None for every row;
``row_params.FilterRows`` derives them from the parameters the host holds), never from asking the device
(``nonzero`` is a host sync on a GPU); a processed row whose parameter is off is left unchanged.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
MASS_TOLERANCE = 1e-6


def _rows(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the true entries (for the sort-based references only: a host sync on a GPU)."""
    return mask.nonzero(as_tuple=True)[0]


def _take(
    logits: torch.Tensor, param: torch.Tensor, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if rows is None:
        return logits, param
    return logits.index_select(0, rows), param.index_select(0, rows)


def _put(logits: torch.Tensor, rows: torch.Tensor | None, sub: torch.Tensor, keep: torch.Tensor) -> None:
    if rows is None:  # ``sub`` is ``logits``
        logits.masked_fill_(~keep, NEG_INF)
    else:
        logits.index_copy_(0, rows, sub.masked_fill(~keep, NEG_INF))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``min_p`` [N] (0 = off); logits are already temperature-scaled."""
    sub, mp = _take(logits, min_p, rows)
    probs = sub.softmax(dim=-1)
    keep = probs >= mp.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    _put(logits, rows, sub, keep | (mp <= 0).unsqueeze(1))
    return logits


def apply_top_k(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    rows: torch.Tensor | None = None,
    k_max: int | None = None,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """``top_k`` [N] (<= 0 or >= vocab = off). No sort: the k-th largest value comes from ``topk``; every
    larger logit stays, and of the logits equal to it the lowest ids fill the remaining places.

    ``k_max``: the largest active k of the processed rows, which the caller knows from the host-side
    parameters (without it, it is read from ``top_k``: a host sync on a GPU). The tie pass (a cumulative
    sum over the vocabulary) runs for every row where ``sync_free`` (default: off the CPU) instead of
    asking whether any row ties; on the CPU reading that answer costs nothing and skips the pass."""
    vocab = logits.shape[-1]
    sub, k = _take(logits, top_k, rows)
    active = (k > 0) & (k < vocab)
    k = torch.where(active, k, 1).unsqueeze(1)
    if k_max is None:
        k_max = int(k.max()) if k.numel() else 0
    if k_max < 1:
        return logits
    kth = sub.topk(k_max, dim=-1).values.gather(1, k - 1)
    keep = sub >= kth
    # ties at the k-th value leave more candidates than places; at a k-th value of -inf there is nothing
    # left to mask, so those rows need no tie pass
    excess = (keep.sum(dim=-1, keepdim=True) > k) & (kth > NEG_INF)
    if (logits.device.type != "cpu" if sync_free is None else sync_free) or bool(excess.any()):
        greater, ties = sub > kth, sub == kth
        free = k - greater.sum(dim=-1, keepdim=True)
        keep = torch.where(excess, greater | (ties & (ties.cumsum(dim=-1) <= free)), keep)
    _put(logits, rows, sub, keep | ~active.unsqueeze(1))
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
    return sub.masked_fill(~_prefix_reaching(probs_sorted, order, mass), NEG_INF)


def _prefix_reaching(probs_sorted: torch.Tensor, order: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The keep mask (in vocabulary order) of the shortest prefix in ``order`` reaching ``mass``."""
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    keep_sorted = mass_before < mass.unsqueeze(1) - MASS_TOLERANCE
    keep_sorted[:, 0] = True  # a mass below the tolerance still keeps the most likely token
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


# candidate counts tried before a full sort: a nucleus is usually far smaller than the vocabulary
_TOP_P_CANDIDATES = (64, 1024)


def apply_top_p(
    logits: torch.Tensor,
    top_p: torch.Tensor,
    rows: torch.Tensor | None = None,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """``top_p`` [N] (1 = off).

    Where ``sync_free`` (default: off the CPU), one full stable sort of every row (vLLM's PyTorch path
    does the same): no shape depends on the data, so nothing waits for the device. On the CPU, where
    such waits cost nothing, a full sort of a 50k vocabulary per row costs far more than the rest of
    sampling, so each row is first tried on its ``topk`` candidates, re-ordered by (probability desc,
    id). That answer is the full sort's whenever every kept token is strictly more likely than the least
    likely candidate: then the kept tokens and every token before them in the global order are among the
    candidates. Rows where that does not hold (flat distributions) try more candidates, then the full
    sort. Both give the sort-based definition's mask exactly."""
    vocab = logits.shape[-1]
    sub, mass = _take(logits, top_p, rows)
    inactive = mass >= 1.0
    probs = sub.softmax(dim=-1)
    if logits.device.type != "cpu" if sync_free is None else sync_free:
        probs_sorted, order = probs.sort(dim=-1, descending=True, stable=True)
        _put(logits, rows, sub, _prefix_reaching(probs_sorted, order, mass) | inactive.unsqueeze(1))
        return logits
    keep = torch.zeros_like(sub, dtype=torch.bool)
    todo = torch.arange(sub.shape[0], device=logits.device)
    for count in _TOP_P_CANDIDATES:
        if count >= vocab or not todo.numel():
            break
        values, ids = probs.index_select(0, todo).topk(count, dim=-1)
        by_id = ids.sort(dim=-1, stable=True)  # ties in id order, then by probability, stably
        values = values.gather(1, by_id.indices)
        values, order = values.sort(dim=-1, descending=True, stable=True)
        ids = by_id.values.gather(1, order)
        kept = (values.cumsum(dim=-1) - values) < mass.index_select(0, todo).unsqueeze(1) - MASS_TOLERANCE
        kept[:, 0] = True
        exact = ((kept & (values > values[:, -1:])).sum(dim=-1) == kept.sum(dim=-1)) | inactive[todo]
        done = todo[exact]
        keep[done] = torch.zeros_like(keep[done]).scatter_(1, ids[exact], kept[exact])
        todo = todo[~exact]
    if todo.numel():
        probs_sorted, order = probs.index_select(0, todo).sort(dim=-1, descending=True, stable=True)
        keep[todo] = _prefix_reaching(probs_sorted, order, mass.index_select(0, todo))
    _put(logits, rows, sub, keep | inactive.unsqueeze(1))
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


def apply_typical_p(
    logits: torch.Tensor, typical_p: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``typical_p`` [N] (1 = off): locally typical sampling (Meister et al.)."""
    sub, mass = _take(logits, typical_p, rows)
    logp = sub.log_softmax(dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)
    surprise_gap = (-logp - entropy).abs()  # +inf for tokens already masked out
    order = surprise_gap.sort(dim=-1, stable=True).indices
    keep = _prefix_reaching(probs.gather(1, order), order, mass)
    _put(logits, rows, sub, keep | (mass >= 1.0).unsqueeze(1))
    return logits


def support(logits: torch.Tensor) -> set[int]:
    """Token ids with a finite logit (test and debugging helper for one row)."""
    return set(torch.isfinite(logits).nonzero(as_tuple=True)[0].tolist())
