"""Prompts the target writes: the opened user turn is the chat template's own, seeds of the
training and held-out writers never meet, and only finished, new messages are kept."""

import pytest

from ddserve.engine.weights import load_tokenizer
from ddserve.training.self_prompts import (
    Writer,
    collect,
    heldout_seeds,
    opened_user_turn,
    training_seeds,
    writer,
    writer_ids,
    written_text,
)

EOS = {2}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("system", [None, "The user is a chef. Keep it short."])
def test_opened_user_turn_is_where_the_template_puts_the_message(tok, system):
    msg = "How do I boil an egg?"
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": msg}
    ]
    full = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    opened = opened_user_turn(tok, system)
    assert full.startswith(opened + msg + "<|im_end|>")
    assert opened.endswith("<|im_start|>user\n") and (system or "SmolLM") in opened
    ids = writer_ids(tok, Writer(0, system, "How", "chat"))
    assert tok.decode(ids) == opened + "How"


def test_training_and_heldout_seeds_never_meet():
    for s in (0, 1, 7):
        train, held = training_seeds(10**7, s), heldout_seeds(10**7, s)
        assert train.stop <= held.start or held.stop <= train.start
        others = [training_seeds(10**7, s + 1), heldout_seeds(10**7, s + 1)]
        assert all(r.start >= max(train.stop, held.stop) for r in others)


def test_writers_are_drawn_from_their_seed_alone():
    ws = [writer(s) for s in range(400)]
    assert ws == [writer(s) for s in range(400)]
    assert len({w.system for w in ws}) > 250  # varied hints
    assert 0.1 < sum(w.domain == "code" for w in ws) / 400 < 0.35
    assert {writer(s, code_share=0.0).domain for s in range(400)} == {"chat"}


def test_only_finished_messages_of_the_right_length_are_kept(tok):
    w = Writer(0, None, "Why", "chat")
    body = tok.encode(" is the sky blue?", add_special_tokens=False)
    assert written_text(tok, w, body + [2], "stop", EOS) == "Why is the sky blue?"
    assert written_text(tok, w, body, "length", EOS) is None  # cut by max_tokens
    assert written_text(tok, w, body[:2] + [2], "stop", EOS, min_tokens=4) is None
    assert written_text(tok, w, body + [2], "stop", EOS, max_tokens=3) is None
    marker = tok.encode(" hi<|im_start|>assistant", add_special_tokens=False)
    assert written_text(tok, w, marker + [2], "stop", EOS) is None


def test_collect_drops_repeats_and_excluded_texts():
    ws = [Writer(i, None, "", "code" if i == 1 else "chat") for i in range(4)]
    texts = ["Tell me a joke.", "Write a sort.", "tell me a  JOKE.", None]
    out = collect(ws, texts, {"write a sort."}, {"chat": "self_chat", "code": "self_code"})
    assert [(p.text, p.source) for p in out] == [("Tell me a joke.", "self_chat")]
