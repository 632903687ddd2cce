"""Corpus generation through ddserve's engine: concurrent requests give what one request at a
time gives, seeded samples repeat, the deadline stops new requests, and the stage keeps every
held-out prompt out of the training corpus even when the target writes it for both."""

import asyncio
import time

import pytest

from ddserve.bench.prompts import CHAT_PROMPTS
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.weights import load_model
from ddserve.training import corpus as corpus_mod
from ddserve.training.corpus import Answer, CorpusEngine, Job, run_jobs, stage_corpus
from ddserve.training.corpus_store import Corpus, load_parts
from ddserve.training.dflash import parser
from ddserve.training.prompts import normalized
from ddserve.training.self_prompts import Writer

PROMPTS = [[1, 5 + i, 6, 7, 8 + i] for i in range(4)]


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(
        model="tiny-random", device="cpu", max_batch=4, drafter={"kind": "none"},
        params={"budget": 0},
    )  # fmt: skip
    r = EngineRunner(cfg)
    r.start()
    yield r
    r.shutdown()


def run(runner, jobs, concurrency, deadline=float("inf")):
    return asyncio.run(run_jobs(runner, jobs, concurrency, deadline, "test"))


def test_concurrent_requests_answer_as_one_at_a_time(runner):
    greedy = [Job(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    alone = run(runner, greedy, 1)
    together = run(runner, greedy, 4)
    assert [a.tokens for a in together] == [a.tokens for a in alone]
    assert {len(a.tokens) for a in alone} == {8} and len({tuple(a.tokens) for a in alone}) > 1
    sampled = [
        Job(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s))
        for s in (1, 2, 1, 2)
    ]
    first, again = run(runner, sampled, 4), run(runner, sampled, 2)
    assert [a.tokens for a in first] == [a.tokens for a in again]  # a seed per request
    assert first[0].tokens == first[2].tokens and first[0].tokens != first[1].tokens


def test_no_request_starts_after_the_deadline(runner):
    jobs = [Job(p, SamplingParams(max_tokens=4)) for p in PROMPTS]
    assert run(runner, jobs, 2, deadline=time.time() - 1) == [None] * 4


@pytest.fixture(scope="module")
def tiny_lm():
    return load_model("tiny-random")


def small_args(work, *extra):
    args = parser().parse_args(
        ["--model", "tiny-random", "--device", "cpu", "--work", str(work), "--prompts", "20",
         "--self-prompts", "12", "--heldout-self", "3", "--continuations", "4",
         "--gen-tokens", "12", "--engine-batch", "4", *extra]
    )  # fmt: skip
    args.concurrency = args.engine_batch
    return args


def test_stage_keeps_heldout_prompts_out_of_training(tmp_path, tiny_lm, monkeypatch):
    """The 'target' (a fake run) writes the same messages for held-out and training seeds,
    one of them a fixed held-out prompt: held-out keeps its own, training gets only the rest."""
    tok = tiny_lm.tokenizer
    shared, mine = "Tell me one fact about owls.", "Write a limerick about a cat."
    written = [
        CHAT_PROMPTS[0],
        shared,
        "Name three rivers in Europe.",
        "Define entropy in one sentence.",
    ]
    written_train = [CHAT_PROMPTS[0], shared, mine, "Define entropy in one sentence."]

    def fake_run(self, jobs, deadline, label):
        if label in ("heldout_self", "self"):
            texts = written if label == "heldout_self" else written_train
            ids = [
                tok.encode(" " + texts[i % 4], add_special_tokens=False) + [2]
                for i in range(len(jobs))
            ]
            return [Answer(t, "stop") for t in ids]
        return [Answer([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2], "stop") for _ in jobs]

    monkeypatch.setattr(CorpusEngine, "__enter__", lambda self: self)
    monkeypatch.setattr(CorpusEngine, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(CorpusEngine, "run", fake_run)
    monkeypatch.setattr(
        corpus_mod.self_prompts, "writer", lambda seed, share=0.25: Writer(seed, None, "", "chat")
    )
    args = small_args(tmp_path, "--mix", "self_chat=10")  # self-written prompts first
    corpus = stage_corpus(args, tiny_lm, tmp_path)
    held = Corpus.load(tmp_path / "heldout.npz")
    held_texts = held.meta["texts"]
    assert shared in held_texts and CHAT_PROMPTS[0] in held_texts and len(held_texts) == 8 + 41 + 3
    assert held.indices(["heldout_self"]) and held.indices(["heldout_humaneval"])
    train_prompts = {tok.decode(corpus.prompt(p)) for p in range(len(corpus.prompt_source))}
    held_prompts = {tok.decode(held.prompt(p)) for p in range(len(held.prompt_source))}
    assert not train_prompts & held_prompts
    flat = " ".join(normalized(t) for t in train_prompts)
    assert normalized(mine) in flat and normalized(shared) not in flat
    assert normalized(CHAT_PROMPTS[0]) not in flat
    assert len(load_parts(tmp_path)) == len(corpus) == 2 * 20  # every prompt at T=0 and T=1
    assert set(corpus.answer_temperature.tolist()) == {0.0, 1.0}
