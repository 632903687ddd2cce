"""Text around token ids: chat templates and incremental detokenization with stop strings."""

from __future__ import annotations

import bisect

from ddserve.api.pieces import encode_pieces
from ddserve.errors import InvalidRequest


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids of a chat, through the model's own chat template."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send token ids to /generate")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja errors for messages the template rejects
        raise InvalidRequest(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return encode(tokenizer, text)  # as the template's own tokenize=True does


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
    ids = encode_pieces(tokenizer, text)  # a long text: in parallel pieces, the same ids
    return ids if ids is not None else list(tokenizer.encode(text, add_special_tokens=False))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Incremental: each push decodes only the new ids with the previous chunk's ids as context
    (so tokenizers that drop a leading space when decoding alone still join correctly), not
    the whole answer again. Holds back an incomplete UTF-8 character and any tail that could
    begin a stop string, so a client never sees a stop string or half a character.

    With `per_token` (requests that return log-probs) ids are decoded one at a time and each
    token's text end is kept (`ends`): `complete` counts the tokens whose text lies wholly
    within the text returned so far, `start(i)` is where token i's text begins. A character
    whose bytes span several tokens ends all of them (it belongs to the first)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, per_token: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context the next ids are decoded after
        self.read = 0  # ids[:read] are in self.text
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.per_token = per_token
        self.ends: list[int] = []  # per_token: len(text) once token i's bytes were decoded

    def _ended(self, length: int) -> None:
        """Tokens decoded by now (all of them without a tokenizer) end at `length`."""
        done = len(self.ids) if self.tokenizer is None else self.read
        self.ends += [length] * (done - len(self.ends))

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

    @property
    def complete(self) -> int:
        """Tokens whose text lies wholly within the text returned so far (per_token)."""
        return bisect.bisect_right(self.ends, self.emitted)

    def start(self, i: int) -> int:
        """Where token i's text begins in the text (per_token)."""
        return self.ends[i - 1] if i else 0

    def push(self, ids: list[int]) -> str:
        """Add new ids; return the text that is now safe to show."""
        if self.per_token and len(ids) > 1:
            return "".join(self._push([t]) for t in ids)
        return self._push(ids)

    def _push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self.text + self._decode_new()
        if self.per_token:
            self._ended(len(full))
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
            if self.per_token:
                self._ended(len(self.text))
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary
    writes for each byte -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


class TokenStrings:
    """Token id -> (text, UTF-8 bytes) as OpenAI's log-probs show a token: the text is the
    token decoded alone (special tokens by name; half a character as U+FFFD), the bytes are
    the token's own bytes for a byte-level BPE vocabulary (so the bytes of consecutive
    tokens join into the text), else the text's UTF-8. Cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.bytes_of = _byte_decoder() if type(decoder).__name__ == "ByteLevel" else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is not None:
            return hit
        if self.tokenizer is None:
            text, raw = "", []
        else:
            text = self.tokenizer.decode([token_id])
            raw = list(text.encode("utf-8"))
            if self.bytes_of is not None:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self.bytes_of for c in piece):
                    raw = [self.bytes_of[c] for c in piece]
        if len(self.cache) < 1 << 17:
            self.cache[token_id] = (text, raw)
        return text, raw
