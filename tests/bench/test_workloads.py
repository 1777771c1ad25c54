"""Workload streams: lengths, determinism, shared prefixes per tenant, ShareGPT files."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from kvpilot.bench.config import ConfigError, WorkloadConfig
from kvpilot.bench.sharegpt import DatasetError, load_sharegpt
from kvpilot.bench.wordlist import WORDS, random_words
from kvpilot.bench.workloads import Workload


def _take(config: WorkloadConfig, count: int, seed: int = 0):
    return list(itertools.islice(Workload(config).stream(np.random.default_rng(seed)), count))


def test_random_workload_lengths_stay_in_range_and_prompts_use_the_word_list():
    specs = _take(WorkloadConfig(input_len_range=(5, 9), output_len_range=(3, 4)), 300)
    assert [s.index for s in specs] == list(range(300))
    assert {len(s.prompt.split()) for s in specs} == {5, 6, 7, 8, 9}
    assert all(len(s.prompt.split()) == s.prompt_words for s in specs)
    assert {s.max_tokens for s in specs} == {3, 4}
    assert set(" ".join(s.prompt for s in specs).split()) <= set(WORDS)
    assert all(s.tenant is None and s.system_prompt is None for s in specs)


def test_same_seed_same_requests():
    config = WorkloadConfig(input_len_range=(5, 50))
    assert _take(config, 20, seed=3) == _take(config, 20, seed=3)
    assert _take(config, 20, seed=3) != _take(config, 20, seed=4)


def test_word_list_prompts_have_the_asked_word_count():
    assert len(random_words(np.random.default_rng(0), 777).split(" ")) == 777
    assert len(WORDS) == len(set(WORDS)) == 258
    with pytest.raises(ValueError):
        random_words(np.random.default_rng(0), 0)


def test_shared_prefix_tenants_share_one_system_prompt_each():
    config = WorkloadConfig(kind="shared-prefix", num_tenants=3, system_prompt_len=40, input_len_range=(4, 8))
    specs = _take(config, 200)
    by_tenant: dict[str, set[str]] = {}
    for spec in specs:
        by_tenant.setdefault(spec.tenant, set()).add(spec.system_prompt)
        assert spec.prompt_words == 41 + len(spec.prompt.split())  # "tenant-k:" + 40 words + user part
    assert sorted(by_tenant) == ["tenant-0", "tenant-1", "tenant-2"]
    assert all(len(prompts) == 1 for prompts in by_tenant.values())
    system_prompts = [next(iter(p)) for p in by_tenant.values()]
    assert len(set(system_prompts)) == 3
    assert all(p.startswith(t + ": ") for t, p in zip(by_tenant, system_prompts, strict=True))
    assert len(set(s.prompt for s in specs)) == 200  # user parts differ


def test_streams_of_one_workload_share_tenant_prompts_but_not_user_parts():
    workload = Workload(
        WorkloadConfig(kind="shared-prefix", num_tenants=2, system_prompt_len=10), tenant_seed=9
    )
    first = list(itertools.islice(workload.stream(np.random.default_rng(1)), 30))
    second = list(itertools.islice(workload.stream(np.random.default_rng(2)), 30))
    assert (
        {s.system_prompt for s in first} == {s.system_prompt for s in second} == set(workload.system_prompts)
    )
    assert not {s.prompt for s in first} & {s.prompt for s in second}
    other_tenants = Workload(workload.config, tenant_seed=10).system_prompts
    assert not set(other_tenants) & set(workload.system_prompts)


def _write_sharegpt(tmp_path, entries) -> WorkloadConfig:
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(entries))
    return WorkloadConfig(kind="sharegpt", dataset_path=path, sharegpt_output_cap=5)


SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "what is two plus two"},
            {"from": "gpt", "value": "it is four"},
        ]
    },
    {
        "conversations": [
            {"from": "gpt", "value": "starts with the answer"},
            {"from": "human", "value": "skipped"},
        ]
    },
    {"id": "no conversations"},
    {
        "conversations": [
            {"from": "human", "value": "tell a long story"},
            {"from": "gpt", "value": "once upon a time there was a tiny model"},
        ]
    },
]


def test_sharegpt_uses_first_human_turn_and_caps_output(tmp_path):
    config = _write_sharegpt(tmp_path, SHAREGPT)
    pairs = load_sharegpt(config.dataset_path)
    assert [(p.prompt, p.answer_words) for p in pairs] == [
        ("what is two plus two", 3),
        ("tell a long story", 9),
    ]
    specs = _take(config, 6)
    # Every round visits each usable entry once, in a seeded order.
    for round_start in (0, 2, 4):
        assert sorted(s.prompt for s in specs[round_start : round_start + 2]) == [
            "tell a long story",
            "what is two plus two",
        ]
    lengths = {s.prompt: (s.max_tokens, s.prompt_words) for s in specs}
    assert lengths == {"what is two plus two": (3, 5), "tell a long story": (5, 4)}  # 9 words capped at 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"conversations": []}', "expected a JSON list"),
        ('[{"conversations": [{"from": "human", "value": "only a question"}]}]', "no entry has"),
    ],
)
def test_unusable_sharegpt_files_are_rejected_with_the_reason(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_sharegpt(path)


def test_workload_config_validation_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--input-len needs 1 <= MIN <= MAX"):
        WorkloadConfig(input_len_range=(9, 2)).validate()
    with pytest.raises(ConfigError, match="needs --dataset-path"):
        WorkloadConfig(kind="sharegpt").validate()
    with pytest.raises(ConfigError, match="is not a readable file"):
        WorkloadConfig(kind="sharegpt", dataset_path=tmp_path / "missing.json").validate()
    with pytest.raises(ConfigError, match="only used with --workload sharegpt"):
        WorkloadConfig(dataset_path=tmp_path).validate()
