"""The corpus' prompt sources: HumanEval's split, held-out prompts kept out of training, the
weighted mix, and chat vs raw prompt ids."""

import pytest

from ddserve.bench.prompts import CHAT_PROMPTS, chat_ids
from ddserve.engine.weights import load_tokenizer
from ddserve.training.corpus import fixed_sources
from ddserve.training.prompts import (
    SOURCES,
    Prompt,
    heldout_fixed,
    heldout_prompts,
    humaneval_split,
    mix,
    normalized,
    prompt_ids,
    without,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def test_humaneval_split_holds_out_every_fourth_problem():
    train, held = humaneval_split()
    assert (len(train), len(held)) == (123, 41)
    assert not set(train) & set(held)
    assert "def has_close_elements" in held[0]  # HumanEval/0
    assert heldout_prompts() == list(CHAT_PROMPTS) + held  # bench's engine_cpu reads this order


def test_no_training_source_holds_a_heldout_prompt():
    held = {normalized(p.text) for p in heldout_fixed()}
    sources = fixed_sources(seed=0, continuations=200)
    assert {len(v) > 0 for v in sources.values()} == {True}
    assert set(sources) <= set(SOURCES) and not any(s.startswith("heldout") for s in sources)
    for name, prompts in sources.items():
        assert not held & {normalized(p.text) for p in prompts}, name


def test_without_drops_heldout_texts_and_repeats():
    sources = {
        "self_chat": [Prompt("  explain what a HASH table is in three sentences.", "self_chat")],
        "templated": [
            Prompt("Write a haiku.", "templated"),
            Prompt("write a  haiku.", "templated"),
        ],
    }
    out = without(sources, {normalized(CHAT_PROMPTS[2])})
    assert out == {"self_chat": [], "templated": [Prompt("Write a haiku.", "templated")]}


def test_mix_keeps_the_weights_in_every_prefix_and_redistributes():
    sources = {
        "a": [Prompt(f"a{i}", "templated") for i in range(1000)],
        "b": [Prompt(f"b{i}", "templated") for i in range(1000)],
        "c": [Prompt(f"c{i}", "templated") for i in range(10)],
    }
    out = mix(sources, {"a": 0.5, "b": 0.3, "c": 0.2}, 600)
    head = [p.text[0] for p in out[:50]]
    assert (head.count("a"), head.count("b"), head.count("c")) == (25, 15, 10)
    assert [p.text for p in out if p.text[0] == "a"][:3] == ["a0", "a1", "a2"]  # in order
    rest = [p.text[0] for p in out[50:]]  # c ran out: a and b share its weight 5:3
    assert "c" not in rest and abs(rest.count("a") / len(rest) - 5 / 8) < 0.01
    assert len(out) == 600 and out == mix(sources, {"a": 0.5, "b": 0.3, "c": 0.2}, 600)
    assert len(mix(sources, {"a": 1, "c": 1}, 10**6)) == 1010  # every prompt once


def test_prompt_ids_use_the_chat_template_only_for_chat_prompts(tok):
    prompts = [Prompt("def f(x):\n", "raw_code", chat=False), Prompt("Hi there", "self_chat")]
    raw, chat = prompt_ids(tok, prompts)
    assert raw == tok.encode("def f(x):\n", add_special_tokens=False)
    assert chat == chat_ids(tok, ["Hi there"])[0]
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")
