"""Chat-style benchmark prompts (written for ddserve; a mix of code, editing and Q&A)."""

from ddserve.api.text import render_chat


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
