"""Long texts encoded in parallel pieces (ddserve.api.pieces) give exactly the ids of one
encode: random texts of words, digits, punctuation, runs of spaces, tabs and newlines,
apostrophes, accents, CJK, combining marks and the chat template's special tokens, through
the bundled SmolLM2 tokenizer (ByteLevel, GPT-2's regex), the same as transformers 5.17 builds
it (an empty Sequence normalizer, byte fallback), and one built from its vocabulary with
Llama 3's Split regex and an NFC normalizer; cut small so every text has many cuts.
A tokenizer whose stages could break that is encoded whole."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddserve.api import pieces
from ddserve.api.pieces import KNOWN_SPLITS, cut_points, encode_pieces, splittable
from ddserve.api.text import encode, render_chat
from ddserve.engine.weights import load_tokenizer

ATOMS = [
    "hello", "World", "it's", "we'LL", "x", "123", "45678", "3.14", " ", "  ", "   ", "\t",
    "\n", "\n\n", " \n", "\r\n", "!", "?!", "...", "(", ")", "'", "\"", "-", "_", "#", "{}",
    "café", "e\u0301", "\u0301", "日本語", "中", "ß", "😀", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "def f(x):", "    return x", "ÅngstrÖm", "١٢٣", "Ⅻ",
]  # fmt: skip
texts = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=160).map("".join)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def llama3_style(smollm2):
    """SmolLM2's vocabulary and merges behind Llama 3's pre-tokenizer and an NFC normalizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    d = json.loads(smollm2.backend_tokenizer.to_str())
    d["normalizer"] = {"type": "NFC"}
    pattern = next(p for p in KNOWN_SPLITS if r"\p{N}{1,3}" in p)
    d["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)))
    assert splittable(tok.backend_tokenizer)
    return tok


@pytest.fixture(scope="module")
def smollm2_as_loaded_on_the_gpu_host(smollm2):
    """SmolLM2's tokenizer as transformers 5.17 / tokenizers 0.23.2 build it from the GGUF
    (the lent H200's image): an empty Sequence normalizer and BPE with byte fallback. It was
    encoded whole there, 12.3 ms for a 7,200-token prompt (bench/NOTES.md)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    d = json.loads(smollm2.backend_tokenizer.to_str())
    d["normalizer"] = {"type": "Sequence", "normalizers": []}
    d["model"]["byte_fallback"] = True
    d["pre_tokenizer"]["trim_offsets"] = False
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)))
    assert splittable(tok.backend_tokenizer)
    return tok


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_CHARS", 4)


def whole(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, threads=st.integers(2, 9))
def test_pieces_equal_one_encode_gpt2_regex(smollm2, small_pieces, text, threads):
    got = encode_pieces(smollm2, text, threads)
    if got is not None:  # None: no cut point (then `encode` encodes it whole)
        assert got == whole(smollm2, text)
    assert encode(smollm2, text) == whole(smollm2, text)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, threads=st.integers(2, 9))
def test_pieces_equal_one_encode_as_loaded_on_the_gpu_host(
    smollm2_as_loaded_on_the_gpu_host, small_pieces, text, threads
):
    tok = smollm2_as_loaded_on_the_gpu_host
    got = encode_pieces(tok, text, threads)
    if got is not None:
        assert got == whole(tok, text)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, threads=st.integers(2, 9))
def test_pieces_equal_one_encode_llama3_regex(llama3_style, small_pieces, text, threads):
    got = encode_pieces(llama3_style, text, threads)
    if got is not None:
        assert got == whole(llama3_style, text)


def test_cuts_fall_at_a_space_after_a_non_space(small_pieces):
    text = "ab  cd\t ef\n gh ij" * 5
    cuts = cut_points(text, 6)
    assert cuts and cuts == sorted(cuts)
    assert all(text[i] == " " and not text[i - 1].isspace() for i in cuts)
    assert all(b - a >= pieces.PIECE_CHARS for a, b in zip([0, *cuts], cuts, strict=False))
    assert cut_points("x" * 100, 4) == []  # no space: encoded whole


def test_a_cut_anywhere_else_would_change_the_ids(smollm2):
    """What the cut rule guards against (so the tests above can fail): cut inside a word, or
    after a space, a text encodes into other ids."""
    text = "internationalization  is long"
    inside = text.index("nation")
    after_space = text.index(" long") + 1
    for at in (inside, after_space):
        ids = whole(smollm2, text[:at]) + whole(smollm2, text[at:])
        assert ids != whole(smollm2, text)


def test_a_long_chat_renders_to_the_templates_own_ids(smollm2, small_pieces):
    words = " ".join(f"w{i} café, 12 {'x' * (i % 7)}" for i in range(3000))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}]
    ids = render_chat(smollm2, messages)
    out = smollm2.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(
    "change",
    [
        "prefix_space",
        "metaspace",
        "unknown_split",
        "lstrip_token",
        "spaced_token",
        "dropout",
        "nfkc",
        "nfkc_in_a_sequence",
    ],
)
def test_tokenizers_that_could_differ_are_encoded_whole(smollm2, change):
    from tokenizers import Tokenizer

    d = json.loads(smollm2.backend_tokenizer.to_str())
    if change == "prefix_space":
        d["pre_tokenizer"]["add_prefix_space"] = True
    elif change == "metaspace":
        d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}  # fmt: skip
    elif change == "unknown_split":
        d["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\w+\s?"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }  # fmt: skip
    elif change == "lstrip_token":
        d["added_tokens"][1]["lstrip"] = True
    elif change == "spaced_token":
        d["added_tokens"].append({**d["added_tokens"][1], "id": 49152, "content": "two words"})
    elif change == "dropout":
        d["model"]["dropout"] = 0.1
    elif change == "nfkc":
        d["normalizer"] = {"type": "NFKC"}
    elif change == "nfkc_in_a_sequence":
        d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFKC"}]}
    assert not splittable(Tokenizer.from_str(json.dumps(d)))


def test_a_token_added_after_load_or_split_special_tokens_is_honoured(small_pieces):
    """The decision follows the tokenizer: a token added later (with a space in it) makes it
    encode whole; `split_special_tokens` (special-token text read as text) too, as one
    encode would."""
    tok = load_tokenizer("smollm2-135m")  # its own object: this test changes it
    text = "hello world <|im_end|> world again and again " * 4
    assert encode_pieces(tok, text, 4) == whole(tok, text)
    tok.split_special_tokens = True
    assert encode_pieces(tok, text, 4) is None
    assert encode(tok, text) == whole(tok, text)
    tok.split_special_tokens = False
    tok.add_tokens(["lo wo"])
    assert encode_pieces(tok, text, 4) is None
    assert encode(tok, text) == whole(tok, text)
