"""The model's tokenizer and chat template, shared by the engine and the router.

The router must turn a request into exactly the token ids the engine will see (its block hashes depend on
them), so both build this class from the same model directory: ``tokenizer.json`` through HF
``tokenizers``, special tokens and the chat template from ``tokenizer_config.json`` (or
``chat_template.jinja``), end-of-sequence ids from ``config.json`` and ``generation_config.json``.

The chat template is rendered the way HF transformers renders it (sandboxed jinja2, trim_blocks,
lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``, special tokens as variables), so a prompt
rendered here matches ``AutoTokenizer.apply_chat_template`` for the same model.

This module must not import torch: the router imports it and has no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
        fallback_bos_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self._special_tokens = {name: special_tokens.get(name) for name in _SPECIAL_TOKEN_NAMES}
        for name, token in self._special_tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        self.chat_template = chat_template
        self._template = _compile_chat_template(chat_template) if chat_template is not None else None
        self.bos_token_id = self._id_of("bos_token")
        if self.bos_token_id is None:
            self.bos_token_id = fallback_bos_token_id
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.unk_token_id = self._id_of("unk_token")
        eos_ids = {int(i) for i in extra_eos_token_ids}
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        named = {
            i
            for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
            if i is not None
        }
        added_special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        self.all_special_ids: tuple[int, ...] = tuple(sorted(named | added_special))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of an HF-format model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (kvpilot needs an HF fast-tokenizer file)")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        settings = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")
        template_file = path / "chat_template.jinja"
        # transformers gives a separate chat_template.jinja precedence over tokenizer_config.json.
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _default_template(settings.get("chat_template"), path)
        )
        special = {name: _token_content(settings.get(name), name, path) for name in _SPECIAL_TOKEN_NAMES}
        eos_ids = _as_id_list(model_config.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id"))
        try:
            return cls(
                backend, special, template, eos_ids, fallback_bos_token_id=model_config.get("bos_token_id")
            )
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @property
    def backend(self) -> BackendTokenizer:
        """The HF ``tokenizers.Tokenizer`` underneath (its pre-tokenizer and model, for exact re-use)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (a model's embedding table may be padded beyond it)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens["eos_token"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) become their single ids.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. a BOS), if anything.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids past :attr:`vocab_size` (padded embedding rows) decode to nothing, as in
        HF."""
        return self._backend.decode(_checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        """Vocabulary strings (byte-level spelling, e.g. ``Ġthe``) of ``ids``; None for unknown ids."""
        if isinstance(ids, int) and not isinstance(ids, bool):
            return self._backend.id_to_token(_checked_ids([ids])[0])
        return [self._backend.id_to_token(i) for i in _checked_ids(ids)]

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        **template_kwargs: Any,
    ) -> str: ...
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tokenize: Literal[True],
        **template_kwargs: Any,
    ) -> list[int]: ...
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        **template_kwargs: Any,
    ) -> list[int]: ...
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        **template_kwargs: Any,
    ) -> str | list[int]: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (token ids if ``tokenize``).

        Extra keyword arguments become template variables (``tools=...``, ``enable_thinking=...``), as in HF.
        The rendered prompt already holds the template's special tokens, so tokenizing adds no others.
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of chat messages")
        _check_messages(messages)
        variables = {name: token for name, token in self._special_tokens.items() if token is not None}
        variables.update(template_kwargs)
        try:
            prompt = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError) as error:
            raise ValueError(f"chat template could not render these messages: {error}") from None
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt

    def _id_of(self, name: str) -> int | None:
        token = self._special_tokens[name]
        return None if token is None else self._backend.token_to_id(token)


def _compile_chat_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # HF's tojson keeps non-ASCII text readable, unlike jinja2's built-in filter.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"chat template is not valid jinja2 (line {error.lineno}): {error.message}"
        ) from None


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}].role must be a non-empty string")
        content = message.get("content")
        # A list is OpenAI's content-parts form; the template decides what to do with it. An assistant
        # message that calls tools may have no content.
        if not isinstance(content, (str, list)) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{index}].content must be a string or a list of content parts")


def _checked_ids(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
    checked = list(ids)
    for token_id in checked:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"token ids must be non-negative ints, got {token_id!r}")
    return checked


def _default_template(template: Any, path: Path) -> str | None:
    # tokenizer_config.json may hold one template or a list of named ones ({"name", "template"}).
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{path}: chat_template must be a string or a list with a 'default' entry")


def _token_content(value: Any, name: str, path: Path) -> str | None:
    # transformers writes special tokens either as a plain string or as a serialized AddedToken.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: tokenizer_config.json {name} must be a string or an object with 'content'")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return document
