"""The DFlash block drafter: training-time block forward == the engine's drafter, the engine
feeds it the target's own hidden states, saved weights round-trip, and a trained drafter
beats an untrained one (a few steps of the real training loop on a tiny target)."""

import random

import pytest
import torch

from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import DFlashConfig, DFlashDrafter, DFlashModel, load_dflash, save_dflash
from ddserve.engine.drafters import DraftContext
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.weights import random_llama, tiny_config, to_hf
from ddserve.errors import ConfigError
from ddserve.training.dflash_blocks import block_forward, make_batch, target_taps
from tests.engine.reference import ReferenceDFlash, ReferenceEngine


@pytest.fixture(scope="module")
def target():
    cfg = tiny_config(vocab_size=256)
    cfg = type(cfg)(**{**cfg.to_dict(), "num_layers": 5, "eos_token_ids": (2,)})
    return random_llama(cfg, seed=11)


def drafter_model(target, seed=0, block=5):
    torch.manual_seed(seed)
    m = DFlashModel(DFlashConfig.for_target(target.cfg, num_layers=2, block_size=block, taps=2))
    with torch.no_grad():
        m.mask_embedding.normal_()
    return m.eval()


def test_capture_equals_transformers_hidden_states(target):
    ids = [1, 7, 9, 30, 31, 32, 7, 9]
    layers = (0, 2)
    _, mine = target(torch.tensor(ids), torch.arange(len(ids)), target.new_cache(), capture=layers)
    ref = target_taps(to_hf(target), torch.tensor([ids]), layers)[0]
    assert torch.allclose(mine, ref, atol=1e-4)


def test_training_blocks_equal_engine_drafter(target):
    """Several blocks packed in one training forward give the same distributions as the
    engine's drafter drafting at each of those roots with its cached context."""
    d = drafter_model(target)
    seq = [random.Random(0).randrange(3, 256) for _ in range(30)]
    ids, anchors, valid = make_batch([(seq, 4)], 4, d.c.block_size, 64, random.Random(1), 0)
    with torch.no_grad():
        taps = target_taps(to_hf(target), ids, d.c.target_layers)
        hidden, labels = block_forward(d, target, ids, anchors, valid, taps)
        train_lp = torch.log_softmax(hidden @ target.lm_head.weight.T, -1)[0]  # [nb, L, V]
    drafter = ReferenceDFlash(d, target)
    for j, a in enumerate(anchors[0].tolist()):
        state = drafter.new_state()
        _, h = target(
            torch.tensor(seq[:a]), torch.arange(a), target.new_cache(), capture=drafter.capture
        )
        ctx = DraftContext(seq[: a + 1], 2048, h)
        lp = drafter.draft(state, ctx, d.c.block_size)
        assert torch.allclose(lp, train_lp[j], atol=1e-4), a
        assert labels[0, j].tolist() == seq[a + 1 : a + 1 + d.c.block_size]


def test_engine_feeds_exactly_the_committed_context(target):
    """After any number of rounds the drafter's context is every committed token but the root,
    so a drafter whose context came incrementally equals one given the whole prefix at once.
    (The reference engine's feeding; the engine's DFlash pool is held to the reference by
    tests/engine/test_static_engine.py: same outputs and accept lengths.)"""
    d = drafter_model(target)
    eng = ReferenceEngine(target, ReferenceDFlash(d, target), 5, (2,))
    prompt = [1, 20, 21, 22, 23, 20, 21]
    seq = eng.new_sequence(prompt, SamplingParams(max_tokens=25, ignore_eos=True))
    eng.prefill(seq)
    params = LiveParams(budget=6, topk=2)
    while not seq.finished:
        eng.step(seq, params)
    incremental = eng.draft(seq, params)
    fresh = ReferenceDFlash(d, target)
    n = len(seq.tokens) - 1
    _, h = target(
        torch.tensor(seq.tokens[:n]), torch.arange(n), target.new_cache(), capture=fresh.capture
    )
    whole = fresh.draft(fresh.new_state(), DraftContext(seq.tokens, 2048, h), 5)
    assert torch.allclose(incremental, whole, atol=1e-4)


def test_window_limits_the_context(target):
    d = drafter_model(target)
    dr = ReferenceDFlash(d, target)
    toks = list(range(3, 40))
    n = len(toks) - 1
    _, h = target(torch.tensor(toks[:n]), torch.arange(n), target.new_cache(), capture=dr.capture)
    st = dr.new_state()
    small = dr.draft(st, DraftContext(toks, 4, h), 5)
    assert st.length == 4 and st.start == n - 4
    big = dr.draft(dr.new_state(), DraftContext(toks, 2048, h), 5)
    assert not torch.allclose(small, big)


def test_save_load_round_trip_and_target_check(target, tmp_path):
    d = drafter_model(target)
    save_dflash(d, tmp_path / "dd", {"steps": 1})
    back = load_dflash(tmp_path / "dd")
    for (k, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-2, rtol=1e-2), k  # stored as bf16
    other = random_llama(tiny_config(vocab_size=300), seed=1)
    with pytest.raises(ConfigError, match="trained for a target"):
        DFlashDrafter(back, other)
    with pytest.raises(ConfigError, match="not a readable DFlash drafter directory"):
        load_dflash(tmp_path / "missing")
