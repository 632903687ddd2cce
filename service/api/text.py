"""Text around token ids: chat templates and incremental detokenization with stop strings."""

from __future__ import annotations

from ddserve.errors import InvalidRequest


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids of a chat, through the model's own chat template."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send token ids to /generate")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # jinja errors for messages the template rejects
        raise InvalidRequest(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def longest_token_chars(tokenizer) -> int | None:
    """Characters one token covers at most (its longest vocabulary entry, bytes for byte-level
    BPE): a text of n characters has at least n / this many tokens. None: unknown."""
    try:
        return max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # no tokenizer, or one without a vocabulary to read
        return None


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send token ids")
    return list(tokenizer.encode(text, add_special_tokens=False))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Incremental: each push decodes only the new ids with the previous chunk's ids as context
    (so tokenizers that drop a leading space when decoding alone still join correctly), not
    the whole answer again. Holds back an incomplete UTF-8 character and any tail that could
    begin a stop string, so a client never sees a stop string or half a character."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context the next ids are decoded after
        self.read = 0  # ids[:read] are in self.text
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode_new(self, final: bool = False) -> str:
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") and not final:
            return ""  # half a character: wait for its other bytes
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def push(self, ids: list[int]) -> str:
        """Add new ids; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self.text + self._decode_new()
        safe = len(full)
        for s in self.stop:
            i = full.find(s, max(0, self.emitted - len(s)))
            if i != -1 and i < safe:
                safe, self.stopped = i, True
        if self.stopped:
            full = full[:safe]
        else:
            for s in self.stop:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if full[:safe].endswith(s[:k]):
                        safe -= k
                        break
        self.text = full
        delta = full[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        """The rest of the text once generation has finished."""
        if not self.stopped:
            self.text += self._decode_new(final=True)
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
