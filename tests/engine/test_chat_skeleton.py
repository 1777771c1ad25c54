"""Chat skeletons: a template that only emits contents renders the same through a skeleton as through jinja
(for any contents), and every template or message that could tell contents apart goes through jinja."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.chat_skeleton import ChatSkeletons, emits_content_only
from kvpilot.engine.tokenizer import Tokenizer, _compile_chat_template

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Content emitted by ~, by attribute, under a type test, twice, and once not at all (a dropped system turn).
EMITTING = (
    "{%- for m in messages %}{% if m.content is string and m.role != 'system' %}"
    "[{{ m.role ~ ':' ~ m.content }}]{{ m['content'] }}{% endif %}{% endfor %}"
    "{{ messages | length }}{{ bos_token }}"
)


def skeletons(source: str, max_shapes: int = 512) -> ChatSkeletons:
    return ChatSkeletons(_compile_chat_template(source), source, max_shapes)


def jinja(source: str, messages: list[dict], add_generation_prompt: bool = True, **variables: object) -> str:
    return _compile_chat_template(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", " ", "\n", "  padded\t", '"quoted" \\ back', "{{ not a tag }}", "\ue000-0\ue001", "<|im_end|>"]
)


@settings(max_examples=150, deadline=None)
@given(contents=st.lists(TEXT, min_size=1, max_size=4), system=st.booleans(), prompt=st.booleans())
def test_skeleton_renders_like_jinja(contents: list[str], system: bool, prompt: bool) -> None:
    roles = (["system"] if system else []) + ["user", "assistant"] * 2
    messages = [{"role": role, "content": text} for role, text in zip(roles, contents, strict=False)]
    for source in (CHATML, EMITTING):
        rendered = skeletons(source).render(messages, prompt, {"bos_token": "<s>"})
        assert rendered == jinja(source, messages, prompt, bos_token="<s>")


def test_skeleton_exact_parts_and_reuse() -> None:
    chat = skeletons(CHATML)
    first = [{"role": "user", "content": "hi"}]
    assert chat.render(first, True, {}) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(chat._skeletons.values()) == [
        (
            (
                "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n",
                "<|im_end|>\n<|im_start|>assistant\n",
            ),
            (0,),
        )
    ]
    assert chat.render([{"role": "user", "content": " x "}], True, {}).endswith(
        "user\n x <|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(chat._skeletons) == 1  # same shape: no second probe
    chat.render(first, False, {})
    chat.render([{"role": "system", "content": "s"}, *first], True, {})
    chat.render(first, True, {"tools": [{"name": "t"}]})
    chat.render([{"role": "user", "content": "hi", "name": "ann"}], True, {})
    assert len(chat._skeletons) == 5  # every field but the contents tells shapes apart


def test_shape_keys_tell_values_of_different_types_apart() -> None:
    chat = skeletons(CHATML)
    for value in (1, 1.0, True, "1", None, "True", [1]):
        chat.render([{"role": "user", "content": "x", "name": value}], True, {})
    assert len(chat._skeletons) == 7
    # Scalars key by repr; a nested value by its JSON.
    assert sorted(key[0] for key in chat._skeletons) == ["j"] + ["r"] * 6


def test_skeleton_shapes_are_bounded() -> None:
    chat = skeletons(CHATML, max_shapes=2)
    for role in ("user", "assistant", "system"):
        chat.render([{"role": role, "content": "x"}], True, {})
    assert len(chat._skeletons) == 2


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0]['content'] | trim }}",
        "{% if messages[0].content %}x{% endif %}",
        "{{ messages[0].content.strip() }}",
        "{{ messages[0]['content'][:5] }}",
        "{{ messages | map(attribute='content') | join }}",
        "{{ messages[0].get('content') }}",
        "{% set c = messages[0].content %}{{ c }}",
        "{% set c %}{{ messages[0].content }}{% endset %}{{ c | trim }}",
        "{% macro show(m) %}{{ m.content }}{% endmacro %}{{ show(messages[0]) }}",
        "{% for c in messages[0].content %}{{ c }}{% endfor %}",
        "{{ messages[0].content if true else '' }}",
        "{{ messages[0].content is string }}{{ strftime_now('%Y') }}",
        "{{ (messages[0].content ~ 'x') is string }}",
    ],
)
def test_templates_that_look_at_contents_are_not_skeletonized(source: str) -> None:
    template = _compile_chat_template(source)
    assert not emits_content_only(template, source)
    assert skeletons(source).render([{"role": "user", "content": "hi"}], True, {}) is None


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content }}",
        "{{ 'a' + messages[0]['content'] ~ 'b' }}",
        "{% if messages[0].content is string %}{{ messages[0].content }}{% endif %}",
        "{{ raise_exception('no') if messages | length > 3 }}{{ messages[-1].content }}",
    ],
)
def test_templates_that_only_emit_contents_pass_the_static_check(source: str) -> None:
    assert emits_content_only(_compile_chat_template(source), source)


@pytest.mark.parametrize(
    "source",
    [
        # Both pass the static check (no content read); the probe render finds what they do.
        "{% for m in messages %}{% for k, v in m.items() %}{% if v == 'x' %}X{% endif %}{{ v }}{% endfor %}"
        "{% endfor %}",
        "{% for m in messages %}{{ m | tojson }}{% endfor %}",
        "{% for m in messages %}{{ m.values() | list | last | length }}{% endfor %}",
    ],
)
def test_probe_render_catches_what_the_static_check_cannot_see(source: str) -> None:
    chat = skeletons(source)
    assert chat.enabled
    messages = [{"role": "user", "content": "x"}]
    assert chat.render(messages, True, {}) is None
    assert chat.render([{"role": "user", "content": "y"}], True, {}) is None


def test_messages_a_skeleton_cannot_key_go_through_jinja() -> None:
    chat = skeletons(CHATML)
    assert chat.render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], True, {}) is None
    assert chat.render([{"role": "user", "content": "hi", "meta": object()}], True, {}) is None
    assert chat._skeletons == {}


def test_tokenizer_uses_skeletons_and_keeps_its_errors(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    assert tokenizer._skeletons is not None and tokenizer._skeletons.enabled
    messages = [{"role": "user", "content": '  spaced "text"\n'}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
        '<|im_start|>user\n  spaced "text"\n<|im_end|>\n<|im_start|>assistant\n'
    )
    assert len(tokenizer._skeletons._skeletons) == 1
    with pytest.raises(ValueError, match="chat template could not render these messages: Unknown role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}])
