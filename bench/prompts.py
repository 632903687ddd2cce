"""Benchmark prompts: the chat set (written for ddserve; a mix of code, editing and Q&A), the
named sets of `ddserve bench --prompts`, and synthetic prompts of a given token count."""

import itertools
from pathlib import Path

from ddserve.api.text import render_chat
from ddserve.errors import ConfigError


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a one-message user chat, through the model's chat template (as served)."""
    return [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]


CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate.",
    "Explain what a hash table is in three sentences.",
    "Repeat this list and add one more fruit at the end: apple, banana, cherry, date, elderberry.",
    "Write a JavaScript function that returns the sum of an array of numbers.",
    "Give me a short recipe for pancakes.",
    "Fix the bug in this code: def add(a, b): return a - b",
    "Translate to French: The cat sleeps on the warm windowsill every afternoon.",
]

# Common English nouns, each a single token (with its leading space) in SmolLM2's vocabulary
# (checked) and, being frequent words, in most BPE vocabularies of 32k+ entries.
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden window table light music paper road market village summer winter "
    "bridge island forest mountain letter answer voice color model signal engine field stone "
    "plant animal ocean train"
).split()


def synthetic_prompts(n_tokens: int, count: int, tokenizer=None) -> list[str]:
    """`count` distinct prompts of about `n_tokens` tokens each: random words from WORDS
    (prompt i draws with seed i, so prompts differ from their first word and no prefix cache
    shares them). With a tokenizer the words are cut to exactly `n_tokens` ids and decoded;
    without one, `n_tokens` words (one token each in SmolLM2's vocabulary, about one in
    others). Counted without the chat template, which the server adds around them."""
    import random

    prompts = []
    for i in range(count):
        words = random.Random(i).choices(WORDS, k=n_tokens)
        text = " ".join(words)
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            while len(ids) < n_tokens:  # a vocabulary that merges words: add more
                text += " " + " ".join(random.Random(i + len(ids)).choices(WORDS, k=n_tokens))
                ids = tokenizer.encode(text, add_special_tokens=False)
            text = tokenizer.decode(ids[:n_tokens])
        prompts.append(text)
    return prompts


def named_set(kind: str) -> list[str]:
    """`--prompts humaneval|chat|mixed`: HumanEval's 164 problems, the chat set, or both
    interleaved."""
    if kind == "chat":
        return list(CHAT_PROMPTS)
    from ddserve.bench.humaneval import humaneval_chat_prompts

    he = humaneval_chat_prompts()
    if kind == "humaneval":
        return he
    return [p for pair in zip(he, itertools.cycle(CHAT_PROMPTS), strict=False) for p in pair]


def local_model_spec(model: str) -> bool:
    """Whether `model` names a model whose tokenizer loads without a network."""
    return (
        model == "smollm2-135m"
        or model.startswith("tiny-random")
        or (model.endswith(".gguf") and Path(model).is_file())
        or Path(model).is_dir()
    )


def synthetic_set(
    n_tokens: int, count: int, model: str, tokenizer_spec: str | None = None
) -> tuple[list[str], str]:
    """`--prompts synthetic`: the prompts, counted by the tokenizer of `tokenizer_spec` (an
    error if it cannot be loaded) or of the served `model` when that is a local model (words
    if it cannot be loaded); and how they were counted."""
    spec = tokenizer_spec or (model if local_model_spec(model) else None)
    tokenizer = None
    if spec:
        from ddserve.engine.weights import load_tokenizer

        try:
            tokenizer = load_tokenizer(spec)
        except ConfigError:
            if tokenizer_spec:
                raise
    how = f"tokenizer of {spec}" if tokenizer is not None else "words, about 1 token each"
    return synthetic_prompts(n_tokens, count, tokenizer), f"synthetic {n_tokens} tokens ({how})"
