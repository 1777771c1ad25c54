"""Run prompts through an engine by hand, checking its invariants after every step (no leaked blocks, slot
rows equal to their sequences, one terminal record each): the engine tests' common driver. Importable
because ``tests/conftest.py`` puts this folder on ``sys.path``."""

from __future__ import annotations

import itertools

_ids = itertools.count()


def run_checked(llm, prompts: list, params) -> list:
    """``params``: one ``SamplingParams`` for every prompt or a list of them. Returns the final outputs in
    prompt order; asserts every block is free or cached once all requests finished."""
    engine = llm.engine
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"run{next(_ids)}" for _ in prompts]
    for rid, prompt, sp in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, prompt, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.pool.num_in_use == 0
    return [done[r] for r in ids]
