"""Speculative decoding's parts: prompt lookup equals its plain definition, greedy acceptance keeps exactly
the target's argmax run, and the sampled rule emits tokens distributed exactly as the target's (a
chi-square test over two-token outputs, with a wrong rule as the negative control it must reject)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.spec_decode.ngram_proposer import NgramConfig, propose, reference_propose
from kvpilot.engine.spec_decode.rejection import PAD, accept_greedy, accept_sampled


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    config = NgramConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert propose(ids, config) == [2, 3, 5]  # the latest earlier "5 6 7" is followed by 2 3 5
    assert propose(ids, config, limit=1) == [2]
    assert propose([1, 2, 3, 4], config) == []  # nothing repeats
    assert propose([4, 4], config) == [4]
    # 2**8 + 1 and 1 share bytes: an unaligned byte match is not a token match
    assert propose([1, 257, 0, 0, 1], NgramConfig(2, 1, 1)) == [257, 0]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramConfig(2, prompt_lookup_min=3, prompt_lookup_max=2)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4) | st.sampled_from([256, 65536, 2**31]), max_size=40),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_prompt_lookup_equals_the_plain_scan(ids, k, n_max, n_min_less):
    config = NgramConfig(k, max(1, n_max - n_min_less), n_max)
    assert propose(ids, config) == reference_propose(ids, config)


def test_greedy_acceptance_keeps_the_matching_prefix_and_the_argmax_after_it():
    argmax = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [7, 4, 5], [3, 4, PAD]])
    tokens, emitted = accept_greedy(argmax, drafts, torch.tensor([3, 3, 3, 2]))
    assert emitted.tolist() == [4, 2, 1, 3]
    assert tokens.tolist() == [[3, 4, 5, 6], [3, 4, PAD, PAD], [3, PAD, PAD, PAD], [3, 4, 5, PAD]]


P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])  # per position
Q = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.4, 0.3, 0.2, 0.1]])  # the draft's, far from P


def _two_tokens(rule, trials: int, seed: int, deterministic: bool) -> torch.Tensor:
    """Each trial's first two output tokens from speculative rounds of k = 2 against position-dependent
    target distributions P (a context-free 'model'), drafting from Q or, deterministically, token 3."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((trials, 2), PAD)
    done = torch.zeros(trials, dtype=torch.long)
    while (done < 2).any():
        rows = (done < 2).nonzero().squeeze(1)
        start = done[rows]
        positions = (start.unsqueeze(1) + torch.arange(3)).clamp(max=2)
        target = P[positions]  # [R, 3, V]
        draft_q = Q[positions[:, :2].clamp(max=1)]
        if deterministic:
            drafts = torch.full((len(rows), 2), 3)
        else:
            drafts = torch.multinomial(draft_q.reshape(-1, 4), 1, generator=gen).view(-1, 2)
        u, final = torch.rand(len(rows), 2, generator=gen), torch.rand(len(rows), generator=gen)
        tokens, emitted = rule(
            target, drafts, torch.full((len(rows),), 2), None if deterministic else draft_q, u, final
        )
        for j in range(2):  # the trial's next output slots
            slot = start + j
            take = (j < emitted) & (slot < 2)
            out[rows[take], slot[take]] = tokens[take, j]
        done[rows] = torch.clamp(start + emitted, max=2)
    return out


def _chi_square(pairs: torch.Tensor) -> float:
    observed = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).double()
    expected = torch.outer(P[0], P[1]).flatten().double() * len(pairs)
    return float(((observed - expected) ** 2 / expected).sum())


def _wrong_rule(target, drafts, num_draft, draft_probs, uniforms, final_uniforms):
    """The classic mistake: after a rejection, draw from the target p instead of norm(max(0, p - q))."""
    tokens, emitted = accept_sampled(target, drafts, num_draft, draft_probs, uniforms, final_uniforms)
    rejected = emitted <= num_draft
    rows = torch.arange(len(tokens))
    at = emitted - 1
    redrawn = torch.searchsorted(target[rows, at].cumsum(1), final_uniforms.unsqueeze(1)).squeeze(1)
    tokens[rows[rejected], at[rejected]] = redrawn[rejected].clamp(max=target.shape[2] - 1)
    return tokens, emitted


CRITICAL = 37.7  # chi-square, 15 degrees of freedom, p = 0.001


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "one-hot"])
def test_sampled_acceptance_emits_the_targets_distribution(deterministic):
    pairs = _two_tokens(accept_sampled, 40_000, seed=1, deterministic=deterministic)
    assert (pairs != PAD).all()
    assert _chi_square(pairs) < CRITICAL


def test_the_chi_square_test_rejects_a_wrong_rule():
    pairs = _two_tokens(_wrong_rule, 40_000, seed=1, deterministic=False)
    assert _chi_square(pairs) > 10 * CRITICAL


def test_a_seeded_rows_tokens_do_not_depend_on_the_rest_of_the_batch():
    target = P[:3].unsqueeze(0).repeat(3, 1, 1)
    drafts = torch.tensor([[3, 2], [0, 1], [1, 1]])
    u, final = torch.tensor([[0.2, 0.9], [0.3, 0.1], [0.5, 0.5]]), torch.tensor([0.4, 0.6, 0.8])
    draft_q = Q.unsqueeze(0).repeat(3, 1, 1)
    together, _ = accept_sampled(target, drafts, torch.tensor([2, 2, 2]), draft_q, u, final)
    alone, _ = accept_sampled(target[1:2], drafts[1:2], torch.tensor([2]), draft_q[1:2], u[1:2], final[1:2])
    assert together[1].tolist() == alone[0].tolist()
