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


def record_step_logits(llm) -> list:
    """Wrap ``llm``'s model runner so every step's logits are kept (float32, on the CPU); returns the list
    they are appended to."""
    logits: list = []
    execute = llm.engine.runner.execute

    def recording(batch):
        out = execute(batch)
        logits.append(out.detach().float().cpu().clone())
        return out

    llm.engine.runner.execute = recording
    return logits
