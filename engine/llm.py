"""The offline API (vLLM-shaped): ``LLM(model=..., **engine_args).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from tqdm.auto import tqdm

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.engine_core import LLMEngine
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.prompt_render import chat_prompt_ids
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.tokenizer import Tokenizer

PromptLike = str | Sequence[int] | dict


class LLM:
    """Batch generation over the engine: every prompt is queued at once and the scheduler batches them."""

    def __init__(self, model: str = "smollm2-135m", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args).create_config())
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built from an already validated ``EngineConfig``."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt is a string, a list of token ids, or a dict with
        ``prompt`` or ``prompt_token_ids``."""
        items = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"got {len(items)} prompts but {len(priority)} priorities")
        # only each request's last output is returned: the engine need not build the others
        final = {id(p): replace(p, output_kind="final_only") for p in params}
        order: dict[str, int] = {}
        for i, (item, p) in enumerate(zip(items, (final[id(p)] for p in params), strict=True)):
            rid = f"gen-{next(self._ids)}"
            prompt = item.get("prompt_token_ids", item.get("prompt")) if isinstance(item, dict) else item
            if prompt is None:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            self.engine.add_request(rid, prompt, p, priority=0 if priority is None else priority[i])
            order[rid] = i
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate."""
        if messages and isinstance(messages[0], list):
            conversations = messages
        else:
            conversations = [cast("list[dict]", messages)]
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": chat_prompt_ids(tok, c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm)
        while any(r is None for r in results) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RuntimeError(f"engine stopped with unfinished requests {missing[:5]}")
        return cast("list[RequestOutput]", results)  # every slot is filled: checked just above


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast("list[int]", items)]  # one prompt given as token ids
    return cast("list[PromptLike]", items)
