"""Routing and the routed experts' computation, in plain PyTorch (docs/architecture.md#mixture-of-experts).

Expert weights are stacked as vLLM and transformers 5 hold them: ``w13`` ``[E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``w2`` ``[E, H, I]``. A routing is ``weights`` float32 ``[T, k]`` and ``ids``
int64 ``[T, k]``; token t's output is ``sum_j weights[t, j] * expert(ids[t, j], x[t])`` with
``expert(e, x) = w2[e] (silu(w1[e] x) * w3[e] x)``.

- ``select_experts``: the router's softmax, top-k and optional renormalisation, in HF's order;
- ``reference_moe``: the definition above computed densely (every expert on every token): the reference
  both fast paths are tested against, never used to serve;
- ``sorted_moe``: the CPU path: the ``T * k`` (token, expert) assignments sorted by expert, so each
  non-empty expert runs one GEMM over its contiguous rows, then one scatter back and a sum over k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.engine.native.ops import NativeOps


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 ``[T, k]``, expert ids int64 ``[T, k]``) from router logits ``[T, E]``.

    Softmax over all experts in float32, then the k largest probabilities, then (``renormalize``) divided
    by their sum: HF's order for Mixtral and Qwen-MoE alike. With renormalisation this equals a softmax
    over the k chosen logits (Mixtral's rule); ranking the probabilities rather than the logits keeps
    ties broken exactly as HF breaks them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    tokens, hidden = x.shape
    experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden or tuple(w2.shape) != (experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(
            f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden size {hidden}"
        )
    if weights.shape != ids.shape or ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(
            f"routing weights {tuple(weights.shape)} / ids {tuple(ids.shape)} for {tokens} tokens"
        )


def reference_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype, computed in float32 for every expert and token
    and then gathered by ``ids``: nothing sorted, padded or skipped."""
    _check(x, w13, w2, weights, ids)
    inter = w13.shape[1] // 2
    gate_up = torch.einsum("th,eoh->teo", x.float(), w13.float())  # [T, E, 2I]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    every = torch.einsum("tei,ehi->teh", act, w2.float())  # [T, E, H]
    chosen = every.gather(1, ids[..., None].expand(-1, -1, every.shape[-1]))  # [T, k, H]
    return (chosen * weights.float()[..., None]).sum(1).to(x.dtype)


def sorted_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    native: NativeOps | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]``: one GEMM pair per non-empty expert over its sorted rows.

    A stable sort of the flattened ids groups each expert's assignments into one contiguous block of the
    gathered input; one host read of the per-expert counts gives the block bounds (the only sync). Each
    expert's weights are read once per call however many tokens chose it, and experts no token chose
    are never touched. ``native`` (float32 on CPU) runs the SiLU-and-multiply as the dense MLP does."""
    _check(x, w13, w2, weights, ids)
    tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    gathered = x.index_select(0, order // top_k)  # [T*k, H], expert by expert
    out = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = torch.mm(gathered[start:end], w13[expert].t())
        if native is not None and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            act = native.silu_mul(gate_up)
        else:
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        torch.mm(act, w2[expert].t(), out=out[start:end])
        start = end
    out.mul_(weights.reshape(-1)[order, None].to(out.dtype))
    # back to (token, slot) order, then each token's k outputs summed
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, top_k, x.shape[1]).sum(1)
