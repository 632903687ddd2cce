"""The trainer end to end on a tiny random target (real engine, CPU): corpus parts, a few
training steps, eval per domain; --init continues a trained drafter and refuses one of
another shape."""

import json

import numpy as np
import pytest

from ddserve.engine.dflash import load_dflash, load_draft_vocab
from ddserve.training.corpus_store import Corpus, load_parts
from ddserve.training.dflash import main

TINY = ["--model", "tiny-random", "--device", "cpu", "--prompts", "16", "--self-prompts", "8",
        "--heldout-self", "2", "--continuations", "4", "--gen-tokens", "12",
        "--write-tokens", "16", "--engine-batch", "8", "--layers", "1", "--taps", "1",
        "--batch", "4", "--blocks-per-seq", "2", "--max-len", "96", "--log-every", "1",
        "--eval-blocks", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("dflash")
    assert main([*TINY, "--work", str(work), "--max-steps", "2", "--out", str(work / "out")]) == 0
    return work


def test_every_stage_writes_its_output(trained):
    corpus = load_parts(trained)
    assert len(corpus) == 2 * 16 and corpus.meta["model"] == "tiny-random"
    assert corpus.answer_tokens.dtype.itemsize == 2
    meta = json.loads((trained / "drafter" / "config.json").read_text())["training"]
    assert meta["steps"] == 2 and meta["sequences"] > 0
    assert (trained / "out" / "model.safetensors").exists()
    # its vocabulary: the corpus answers' tokens (every one here: a tiny corpus), and the
    # special ones; eval's simulated rounds draft from it
    vocab = load_draft_vocab(trained / "out")
    answers = set(load_parts(trained).answer_tokens.tolist())
    assert answers <= set(vocab.tolist()) and len(vocab) == meta["draft_vocab"]["tokens"]
    assert meta["draft_vocab"]["answer_coverage"] == 1.0
    res = json.loads((trained / "eval.json").read_text())
    assert set(res["heldout"]) == {"chat", "code", "legacy"}
    chat, code, legacy = (res["heldout"][k] for k in ("chat", "code", "legacy"))
    own = len(Corpus.load(trained / "heldout.npz").indices(["heldout_self"]))  # a random
    assert 0 <= own <= 2  # target seldom ends its turn: few or none of its messages are kept
    assert (chat["sequences"], code["sequences"], legacy["sequences"]) == (8 + own, 41, 8 + 41)
    for r in (chat, code, legacy):
        assert len(r["agreement_by_depth"]) == 8 and r["blocks"] > 0
        assert 0 <= r["cumulative_agreement_chain"] <= 8
    assert res["agreement_by_depth"] == legacy["agreement_by_depth"]  # the earlier keys
    for r in (chat, code):  # simulated greedy rounds: 1 token a round at least, 9 at most
        assert set(r["tree_tau"]) == {"b8k2", "b16k4", "b32k4"}
        assert all(1.0 <= t <= 9.0 for t in r["tree_tau"].values())
        assert len(r["chain_offsets"]) == 8
    assert "tree_tau" not in legacy  # chat's and code's prompts again
    assert res["tree_tau_vocab"] == len(vocab)
    assert set(res["train_distribution"]) == set(res["gap_next_token"]) == {"chat", "code"}


def test_init_continues_a_drafter_and_refuses_another_shape(trained, tmp_path):
    before = load_dflash(trained / "drafter")
    args = [*TINY, "--work", str(trained), "--stages", "train", "--retrain", "--max-steps", "1"]
    assert main([*args, "--init", str(trained / "out")]) == 0
    after = json.loads((trained / "drafter" / "config.json").read_text())["training"]
    assert after["steps"] == 1 and after["init"] == str(trained / "out")
    assert load_dflash(trained / "drafter").c == before.c
    with pytest.raises(SystemExit, match="config differs"):
        main([*TINY, "--work", str(trained), "--stages", "train", "--retrain", "--layers", "2",
              "--init", str(trained / "out")])  # fmt: skip


def test_a_second_corpus_with_another_training_seed_joins_the_first(trained, tmp_path):
    """--train-seed draws other training prompts under the same held-out set; --corpus-from
    trains on both corpora, less any earlier answer to one of this run's held-out prompts
    (by normalized text) and any greedy answer to a prompt already answered greedily; a
    directory given twice counts once; a corpus of another target is refused."""
    from ddserve.engine.weights import load_model
    from ddserve.training.corpus_merge import with_earlier
    from ddserve.training.prompts import normalized

    tok = load_model("tiny-random").tokenizer
    work = tmp_path / "second"
    assert main([*TINY, "--work", str(work), "--train-seed", "1", "--stages", "corpus"]) == 0
    first, second = load_parts(trained), load_parts(work)
    held = Corpus.load(work / "heldout.npz")
    assert (
        held.prompt_tokens.tolist() == Corpus.load(trained / "heldout.npz").prompt_tokens.tolist()
    )

    def prompts(c, temperature=None):
        return [
            tuple(c.prompt(int(c.answer_prompt[i])).tolist())
            for i in c.indices(temperature=temperature)
        ]

    assert prompts(first) != prompts(second)  # other training prompts
    # an earlier corpus that answered one of this run's held-out prompts (in other case and
    # spacing): that answer goes; its other prompt's greedy and sampled answers stay
    shouted = tok.encode(tok.decode(held.prompt(0).tolist()).upper().replace(" ", "  "))
    leak = Corpus.build(
        [shouted, [5, 6, 7]], ["self_chat", "self_chat"],
        [(0, [1, 2, 3], 0.0), (1, [4, 5], 0.0), (1, [4, 6], 1.0)], first.answer_tokens.dtype.type,
        meta={"model": "tiny-random"},
    )  # fmt: skip
    leak.save(tmp_path / "corpus-000.npz")
    merged = with_earlier(second, [str(trained), str(trained), str(tmp_path)], work, tok)
    held_texts = {normalized(tok.decode(list(p))) for p in prompts(held)}
    assert not held_texts & {normalized(tok.decode(list(p))) for p in prompts(merged)}
    assert len(prompts(merged, 0.0)) == len(set(prompts(merged, 0.0)))  # no greedy repeats
    sampled = len(prompts(second, 1.0)) + len(prompts(first, 1.0)) + 1  # every sampled one
    assert len(prompts(merged, 1.0)) == sampled
    assert (5, 6, 7) in prompts(merged, 0.0) and len(merged) > len(second)
    # and the trainer takes it as its corpus
    args = [*TINY, "--work", str(work), "--stages", "train", "--max-steps", "1"]
    assert main([*args, "--corpus-from", f"{trained},{tmp_path}"]) == 0
    meta = json.loads((work / "drafter" / "config.json").read_text())["training"]
    assert meta["corpus_by_source"] == merged.summary()["by_source"]
    other = tmp_path / "other"
    other.mkdir()
    Corpus.build([[5, 6]], ["self_chat"], [(0, [4], 0.0)], first.answer_tokens.dtype.type,
                 meta={"model": "smollm2-135m"}).save(other / "corpus-000.npz")  # fmt: skip
    with pytest.raises(SystemExit, match="smollm2-135m"):
        with_earlier(second, [str(other)], work, tok)


def test_no_draft_vocab_leaves_none_behind(trained, tmp_path):
    """--draft-vocab 0 drafts from the whole head: an earlier run's vocabulary goes, beside
    the weights and in --out."""
    out = tmp_path / "out"
    args = [*TINY, "--work", str(trained), "--stages", "train", "--retrain", "--max-steps", "1"]
    assert main([*args, "--out", str(out)]) == 0
    assert load_draft_vocab(out) is not None
    assert main([*args, "--draft-vocab", "0", "--out", str(out)]) == 0
    assert load_draft_vocab(trained / "drafter") is None and load_draft_vocab(out) is None
    with pytest.raises(SystemExit, match="--draft-vocab"):
        main([*args, "--draft-vocab", "-1"])


def test_draft_vocab_from_a_corpus_and_a_missing_one(trained, tmp_path):
    """`python -m ddserve.training.draft_vocab --corpus WORK`: the k most frequent answer
    tokens (and the tokenizer's special ones); a directory without corpus parts is one
    readable line, no file."""
    from ddserve.engine.weights import load_model
    from ddserve.training import draft_vocab

    counts = draft_vocab.answer_counts(load_parts(trained), 1 << 16)
    assert draft_vocab.main(["--model", "tiny-random", "--k", "5", "--corpus", str(trained),
                             "--out", str(tmp_path / "v")]) == 0  # fmt: skip
    ids = set(load_draft_vocab(tmp_path / "v").tolist())
    top5 = set(np.argsort(-counts, kind="stable")[:5].tolist())
    tok = load_model("tiny-random").tokenizer
    assert top5 <= ids and ids - top5 <= set(tok.all_special_ids) | {tok.eos_token_id}
    with pytest.raises(SystemExit, match="no corpus-NNN.npz parts"):
        draft_vocab.main(["--model", "tiny-random", "--corpus", str(tmp_path / "none"),
                          "--out", str(tmp_path / "w")])  # fmt: skip
    assert not (tmp_path / "w").exists()
