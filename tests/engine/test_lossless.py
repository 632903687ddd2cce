"""Lossless speculation: DDTree output == plain greedy decoding, and sampled output follows
the target distribution exactly (checked against enumeration, with a wrong verifier that the
same test must catch) — with a logit_bias too; and the log-probs returned are the target's
raw ones at every emitted position."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ddserve.bench.prompts import chat_ids
from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import (
    BUILTIN,
    DFlashConfig,
    DFlashDrafter,
    DFlashModel,
    load_dflash,
    load_draft_vocab,
)
from ddserve.engine.drafters import ModelDrafter, NGramDrafter, NoDrafter
from ddserve.engine.sampling import (
    SampleGroup,
    SamplingParams,
    filtered_probs,
    filtered_probs_rows,
    sample_rows,
)
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import load_model, random_llama, tiny_config
from tests.engine.reference import ReferenceEngine, one_engine

PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7], [1, 300, 301, 302, 303, 304, 300, 301, 302], [1, 42]]


@pytest.fixture(scope="module")
def tiny():
    return random_llama(tiny_config(vocab_size=512), seed=3)


def ar_greedy(model, prompt, n):
    """The oracle: plain greedy decoding by the reference engine."""
    eng = ReferenceEngine(model, NoDrafter(), 1, ())
    return eng.generate(prompt, SamplingParams(max_tokens=n), LiveParams(budget=0)).output


def drafters(model):
    return {
        "ngram": NGramDrafter(model.cfg.vocab_size),
        "draft-model-self": ModelDrafter(model),
        "draft-model-other": ModelDrafter(random_llama(tiny_config(vocab_size=512), seed=4)),
        "layer-skip": ModelDrafter(model, num_layers=1, name="layer-skip"),
        "dflash-untrained": DFlashDrafter(random_dflash(model), model),
    }


def random_dflash(model, seed=5):
    """An untrained block drafter: losslessness must not depend on its quality."""
    torch.manual_seed(seed)
    return DFlashModel(DFlashConfig.for_target(model.cfg, num_layers=1, block_size=6)).eval()


@pytest.mark.parametrize(
    "budget,topk,window",
    [(0, 4, 2048), (1, 1, 2048), (8, 1, 2048), (8, 4, 2048), (16, 4, 4), (32, 8, 64)],
)
def test_greedy_equals_autoregressive_tiny(tiny, budget, topk, window):
    taus = {}
    for prompt in PROMPTS:
        ref = ar_greedy(tiny, prompt, 40)
        for name, drafter in drafters(tiny).items():
            eng = one_engine(tiny, drafter, 6)
            seq = eng.generate(
                prompt,
                SamplingParams(max_tokens=40),
                LiveParams(budget=budget, topk=topk, window=window),
            )
            assert seq.output == ref, (name, prompt)
            taus[name] = max(taus.get(name, 0), seq.stats.tau)
    if budget >= 8 and window >= 64:
        # the target drafting for itself must be accepted almost always: speculation is real
        assert taus["draft-model-self"] > 3.0


def test_eos_and_max_tokens_are_exact(tiny):
    ref = ar_greedy(tiny, PROMPTS[0], 30)
    eos = ref[10]
    eng = one_engine(tiny, ModelDrafter(tiny), 6, (eos,))
    seq = eng.generate(PROMPTS[0], SamplingParams(max_tokens=30), LiveParams(budget=16, topk=2))
    assert seq.output == ref[: ref.index(eos) + 1] and seq.finish_reason == "stop"
    seq = eng.generate(
        PROMPTS[0], SamplingParams(max_tokens=7, ignore_eos=True), LiveParams(budget=16, topk=2)
    )
    assert seq.output == ref[:7] and seq.finish_reason == "length"


@pytest.mark.slow
def test_greedy_equals_autoregressive_smollm2():
    lm = load_model("smollm2-135m")
    m, tok = lm.model, lm.tokenizer
    vocab = load_draft_vocab(BUILTIN["smollm2-135m"])
    assert vocab is not None
    prompts = chat_ids(
        tok,
        [
            "Write a Python function that reverses a list.",
            "List three colours, then list them again.",
        ],
    )
    for prompt in prompts:
        ref = ar_greedy(m, prompt, 48)
        for drafter, budget, topk, window in [
            (NGramDrafter(m.cfg.vocab_size), 8, 4, 2048),
            (NGramDrafter(m.cfg.vocab_size), 16, 1, 32),
            (ModelDrafter(m, 10), 6, 2, 2048),
            # the trained block drafter bundled for this model, with its draft vocabulary
            (DFlashDrafter(load_dflash(BUILTIN["smollm2-135m"]), m, vocab), 3, 1, 2048),
            (DFlashDrafter(load_dflash(BUILTIN["smollm2-135m"]), m, None), 16, 4, 24),
        ]:
            seq = one_engine(m, drafter, 8, m.cfg.eos_token_ids).generate(
                prompt,
                SamplingParams(max_tokens=48),
                LiveParams(budget=budget, topk=topk, window=window),
            )
            assert seq.output == ref[: len(seq.output)] and (
                len(seq.output) == len(ref) or seq.finish_reason == "stop"
            )


def plain_greedy(model, prompt, n, bias=None):
    """The oracle for logit_bias and log-probs, sharing no code with the engine: one plain
    forward over the whole context per token (no cache, no tree); the token is
    argmax(logits + bias). Returns the tokens and log_softmax(logits) [V] at each."""
    ids, out, logprobs = list(prompt), [], []
    for _ in range(n):
        cache = model.new_cache(capacity=len(ids) + 8)
        dev = model.device
        logits = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), cache)
        logits = logits[-1].float()
        biased = logits.clone()
        for t, b in (bias or {}).items():
            biased[t] += b
        out.append(int(biased.argmax()))
        logprobs.append(torch.log_softmax(logits, dim=-1))
        ids.append(out[-1])
    return out, logprobs


def assert_logprobs_match(lp, tokens, oracle, k):
    """Engine log-probs (ddserve.engine.sampling.Logprobs) == the oracle's log_softmax at
    every emitted position, within float32 rounding of differently shaped matmuls; the
    top-k compared by value (robust to near-ties)."""
    assert len(lp) == len(tokens)
    for i, tok in enumerate(tokens):
        ref = oracle[i]
        assert abs(lp.chosen[i] - ref[tok].item()) < 1e-4, (i, lp.chosen[i], ref[tok].item())
        assert len(lp.top_ids[i]) == len(lp.top_logprobs[i]) == k
        want = ref.topk(k).values.tolist()
        assert np.allclose(lp.top_logprobs[i], want, atol=1e-4), i
        assert np.allclose(ref[lp.top_ids[i]].tolist(), lp.top_logprobs[i], atol=1e-4), i


@pytest.mark.parametrize("budget,topk,window", [(0, 1, 2048), (8, 4, 2048), (16, 4, 4)])
def test_logit_bias_and_logprobs_equal_plain_decoding(tiny, budget, topk, window):
    """A bias that changes the greedy path: every drafter's speculative output == plain
    greedy decoding under the same bias, token for token; the log-probs are the raw (unbiased)
    log_softmax of a plain forward at each emitted position."""
    prompt, n = PROMPTS[0], 24
    unbiased, _ = plain_greedy(tiny, prompt, n)
    bias = {unbiased[2]: -100.0, unbiased[7]: -100.0, 300: 2.5, 301: -3.0}
    want, oracle = plain_greedy(tiny, prompt, n, bias)
    assert want[:2] == unbiased[:2] and want != unbiased  # the bias changed the path
    sampling = SamplingParams(max_tokens=n, logprobs=3, logit_bias=tuple(bias.items()))
    taus = {}
    for name, drafter in drafters(tiny).items():
        eng = one_engine(tiny, drafter, 6)
        seq = eng.generate(prompt, sampling, LiveParams(budget=budget, topk=topk, window=window))
        assert seq.output == want, name
        assert_logprobs_match(seq.logprobs, seq.output, oracle, 3)
        taus[name] = seq.stats.tau
    if budget >= 8 and window >= 64:  # drafts were accepted under the bias: nodes verified
        assert taus["draft-model-self"] > 2.0


# -- sampling ---------------------------------------------------------------------------
V = 6


def reference_probs(logits: np.ndarray, t: float, top_p: float, top_k: int) -> np.ndarray:
    """Independent numpy version of the target's sampling distribution for one position."""
    z = logits.astype(np.float64) / t
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = np.zeros_like(p, dtype=bool)
        mass = 0.0
        for i in order:
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def exact_pairs(model, prompt, t, top_p, top_k, bias=None) -> np.ndarray:
    """P(first two tokens = (a, b)) by enumeration with plain forwards (logits + bias)."""
    add = np.zeros(V)
    for tok, b in (bias or {}).items():
        add[tok] = b

    def next_logits(ids):
        cache = model.new_cache()
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1].double().numpy()
        return logits + add

    p1 = reference_probs(next_logits(prompt), t, top_p, top_k)
    out = np.zeros((V, V))
    for a in range(V):
        if p1[a] > 0:
            out[a] = p1[a] * reference_probs(next_logits(prompt + [a]), t, top_p, top_k)
    return out.flatten()


class WrongVerifier(StaticEngine):
    """Accepts the first child whenever the target's sample merely has the same rank-0
    draft in its top-3 — a plausible-looking but biased rule the test must reject."""

    @staticmethod
    def accept_batch(tokens, parents, targets):
        n, w = tokens.shape
        paths, lengths, bonus = (
            np.full((n, w - 1), -1),
            np.zeros(n, np.int64),
            np.zeros(n, np.int64),
        )
        ptoks = paths.copy()
        for r in range(n):
            node = 0
            while (kids := np.flatnonzero(parents[r] == node)).size and (
                targets[r, node] == tokens[r, kids[0]] or targets[r, node] % 2 == 0
            ):
                node = int(kids[0])
                paths[r, lengths[r]], ptoks[r, lengths[r]] = node, tokens[r, node]
                lengths[r] += 1
            bonus[r] = targets[r, node]
        return paths, lengths, bonus, ptoks


def sample_pairs(engine_cls, target, draft, t, top_p, top_k, n, bias=None):
    eng = one_engine(target, ModelDrafter(draft), 3, engine=engine_cls)
    params = LiveParams(budget=6, topk=3)
    counts = np.zeros(V * V)
    rounds = 0
    for seed in range(n):
        seq = eng.generate(
            [1, 2, 3],
            SamplingParams(
                temperature=t,
                top_p=top_p,
                top_k=top_k,
                max_tokens=2,
                ignore_eos=True,
                seed=seed,
                logit_bias=tuple((bias or {}).items()),
            ),
            params,
        )
        counts[seq.output[0] * V + seq.output[1]] += 1
        rounds += seq.stats.verify_rounds
    return counts, rounds / n


def chi2_pvalue(counts, probs):
    mask = probs > 0
    assert counts[~mask].sum() == 0, "sampled a pair the target gives probability 0"
    exp = probs[mask] * counts.sum()
    # merge tiny cells so the chi-square approximation holds
    small = exp < 5
    obs = np.append(counts[mask][~small], counts[mask][small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


@pytest.fixture(scope="module")
def toy():
    cfg = tiny_config(vocab_size=V)
    return random_llama(cfg, seed=11), random_llama(cfg, seed=12)


# a bias that moves mass (and forbids token 2): added before temperature and top-k
BIAS = {0: 1.5, 2: -100.0, 4: -0.7}


@pytest.mark.parametrize(
    "t,top_p,top_k,bias", [(0.7, 1.0, 0, None), (1.0, 1.0, 4, BIAS), (1.5, 0.9, 0, None)]
)
def test_sampling_follows_target_distribution(toy, t, top_p, top_k, bias):
    target, draft = toy
    probs = exact_pairs(target, [1, 2, 3], t, top_p, top_k, bias)
    if bias:  # a sampler that ignored the bias would fail below
        unbiased = exact_pairs(target, [1, 2, 3], t, top_p, top_k)
        assert 0.5 * np.abs(probs - unbiased).sum() > 0.2
    counts, rounds = sample_pairs(StaticEngine, target, draft, t, top_p, top_k, 2500, bias)
    assert rounds < 1.9, "drafts were never accepted: the test would prove nothing"
    assert chi2_pvalue(counts, probs) > 1e-3
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    assert tv < 0.05


def test_sampling_in_one_batch_follows_each_requests_distribution(toy):
    """Requests with different temperatures, top-p, top-k and biases sampled in the same
    rounds (one batched draw for all of them, ddserve.engine.sampling.sample_rows): each
    follows its own exact distribution, and a greedy request in the batch stays greedy."""
    target, draft = toy
    specs = [(0.7, 1.0, 0, None), (1.0, 1.0, 4, BIAS), (1.5, 0.9, 0, None)]
    eng = one_engine(target, ModelDrafter(draft), 3)
    params = LiveParams(budget=6, topk=3)
    greedy_alone = eng.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), params)
    counts = [np.zeros(V * V) for _ in specs]
    rounds = 0
    for run in range(2000):
        sampled = [
            SamplingParams(
                temperature=t,
                top_p=p,
                top_k=k,
                max_tokens=2,
                ignore_eos=True,
                seed=run * len(specs) + i,
                logit_bias=tuple((bias or {}).items()),
            )
            for i, (t, p, k, bias) in enumerate(specs)
        ]
        greedy = SamplingParams(max_tokens=2, ignore_eos=True)
        seqs = [eng.new_sequence([1, 2, 3], sp) for sp in [*sampled, greedy]]
        eng.prefill_batch(seqs)
        while not all(s.finished for s in seqs):
            eng.step_batch([s for s in seqs if not s.finished], params)
        for i, seq in enumerate(seqs[:-1]):
            counts[i][seq.output[0] * V + seq.output[1]] += 1
            rounds += seq.stats.verify_rounds
        assert seqs[-1].output == greedy_alone.output
        for seq in seqs:
            eng.release(seq)
    assert rounds / (2000 * len(specs)) < 1.9, "drafts were never accepted"
    for (t, p, k, bias), c in zip(specs, counts, strict=True):
        probs = exact_pairs(target, [1, 2, 3], t, p, k, bias)
        assert chi2_pvalue(c, probs) > 1e-3, (t, p, k)
        assert 0.5 * np.abs(c / c.sum() - probs).sum() < 0.05, (t, p, k)


@pytest.mark.parametrize("drafter", ["ngram", "dflash-untrained"])
def test_a_seeded_request_samples_alike_alone_and_in_a_batch(tiny, drafter):
    """A seeded sampled request gives the same tokens alone and in rounds it shares with
    others (greedy, other seeds, other temperatures; n-gram trees of other sizes, a late
    joiner): its draws come from its own generator, as many as its own tree needs."""
    from tests.engine.test_batching import PROMPTS as BATCH_PROMPTS
    from tests.engine.test_batching import run_lockstep

    params = LiveParams(budget=6, topk=2)
    mine = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    others = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=18, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.3, top_k=20, max_tokens=30, ignore_eos=True, seed=2),
    ]
    prompts = [PROMPTS[0], *BATCH_PROMPTS[1:4]]
    eng = one_engine(tiny, drafters(tiny)[drafter], 6)
    alone = eng.generate(prompts[0], mine, params).output
    together = run_lockstep(eng, prompts, [mine, *others], params, join_late={2})
    assert together[0] == alone and len(alone) == 24


def test_batched_filter_equals_the_single_request_filter():
    """Row for row, the batched filter (each row its own temperature, top-p, top-k) gives the
    distribution the single-request filter gives with that row's values; a request's draw
    comes from its own generator (the same tokens whoever else is drawn with it, at the same
    width); a row with no finite distribution is flagged, not sampled into another's tokens."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 4
    rows = [
        (0.7, 1.0, 0),
        (1.0, 0.9, 0),
        (1.3, 1.0, 5),
        (0.5, 0.3, 3),
        (2.0, 1.0, 49),
        (1.0, 1.0, 60),
    ]
    params = torch.tensor(rows, dtype=torch.float32)
    got = filtered_probs_rows(logits, params, top_k=True, top_p=True)
    for i, (t, p, k) in enumerate(rows):
        want = filtered_probs(logits[i : i + 1], t, p, k)[0]
        assert torch.allclose(got[i], want, atol=1e-6), rows[i]

    def groups(seeds, sps):
        return [
            SampleGroup(i, 1, sp, None, torch.Generator().manual_seed(sd))
            for i, (sd, sp) in enumerate(zip(seeds, sps, strict=True))
        ]

    sps = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in rows]
    _, alone, _ = sample_rows(logits[:1], groups([7], sps[:1]))
    _, together, ok = sample_rows(logits, groups([7, 1, 2, 3, 4, 5], sps))
    assert together[0] == alone[0] and bool(ok.all())
    broken = logits.clone()
    broken[2] = float("nan")
    _, toks, ok = sample_rows(broken, groups([7, 1, 2, 3, 4, 5], sps))
    assert ok.tolist() == [True, True, False, True, True, True]
    assert toks[0] == alone[0]


def test_wrong_verifier_is_caught(toy):
    target, draft = toy
    probs = exact_pairs(target, [1, 2, 3], 1.0, 1.0, 0)
    counts, _ = sample_pairs(WrongVerifier, target, draft, 1.0, 1.0, 0, 2500)
    assert chi2_pvalue(counts, probs) < 1e-6
