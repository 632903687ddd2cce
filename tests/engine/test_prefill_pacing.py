"""The chunk a round prefills while others decode (ddserve.engine.prefill_pacing): sized from
measured decode steps and prefill speed, within the token cap; an idle engine prefills whole."""

import pytest

from ddserve.engine.prefill_pacing import (
    FIRST_TOKENS,
    IDLE_SAMPLES,
    MIN_TOKENS,
    REFRESH,
    PrefillPacer,
)


def test_an_idle_engine_prefills_whole_and_the_cap_holds_before_any_measurement():
    p = PrefillPacer(2048, 2.0)
    assert p.budget(decoding=False) is None
    assert p.budget(decoding=True) == 2048  # no step measured yet: the token cap
    p.stepped(0.002)
    assert p.budget(decoding=True) == FIRST_TOKENS  # no chunk measured yet
    assert PrefillPacer(-1, 2.0).budget(decoding=True) is None  # no cap, nothing measured


def test_an_idle_engine_chunks_a_prompt_its_prefills_say_would_take_long():
    """Idle, a prompt goes in whole unless the engine's own prefill rate says that takes over
    IDLE_WHOLE_S: then the token cap a round, so a request arriving meanwhile waits one chunk
    (a 2-core CPU took ~54 s for 8,000 tokens in one forward). Before any rate is known, a
    prompt past the cap takes one chunk first, which tells it. A first-use spike does not
    cap a fast device: the fastest of the last IDLE_SAMPLES rates decides."""
    p = PrefillPacer(2048, 1.5)
    assert p.budget(decoding=False, waiting=8000) == 2048  # nothing timed yet: a chunk first
    assert p.budget(decoding=False, waiting=2048) is None  # within the cap: whole anyway
    p.timed(100, 1.0)  # too short to count
    assert p.budget(decoding=False, waiting=8000) == 2048
    fast = PrefillPacer(2048, 1.5)
    fast.timed(2048, 0.004)  # the first chunk, on a GPU: the rest goes in whole
    assert fast.budget(decoding=False, waiting=8000 - 2048) is None
    p.timed(2048, 13.7)  # a CPU: ~6.7 ms a token
    assert p.budget(decoding=False, waiting=8000) == 2048
    assert p.budget(decoding=False, waiting=2048) is None  # within the cap: whole anyway
    assert PrefillPacer(-1, 1.5).budget(decoding=False, waiting=8000) is None  # no cap
    gpu = PrefillPacer(2048, 1.5)
    gpu.timed(7200, 0.013)  # an H200: one forward
    gpu.timed(1024, 3.0)  # a graph captured on first use
    assert gpu.budget(decoding=False, waiting=7200) is None
    assert gpu.budget(decoding=False, waiting=10**6) == 2048  # ~1.8 s whole: chunked
    for _ in range(IDLE_SAMPLES):  # the device got slow for good: the cap again
        gpu.timed(1024, 3.0)
    assert gpu.budget(decoding=False, waiting=7200) == 2048


def test_the_chunk_takes_about_steps_decode_steps():
    p = PrefillPacer(-1, 2.0)
    p.stepped(0.002)  # a 2 ms decode step
    p.prefilled(256, 256 * 5e-6)  # 5 us a token
    assert p.budget(decoding=True) == 800  # 2 x 2 ms / 5 us
    p = PrefillPacer(4096, 2.0)
    p.stepped(0.002)
    p.prefilled(2048, 2048 * 5e-6)
    assert p.budget(decoding=True) == 800
    p = PrefillPacer(512, 2.0)
    p.stepped(0.002)
    p.prefilled(256, 256 * 5e-6)
    assert p.budget(decoding=True) == 512  # within --chunked-prefill-size
    p = PrefillPacer(512, 2.0)
    p.stepped(0.002)
    p.prefilled(256, 0.5)  # prefill far slower than a step (a CPU): short prompts stay whole
    assert p.budget(decoding=True) == MIN_TOKENS
    # beside the decode step (--overlap-prefill) the round takes about the chunk's time
    # alone: the chunk may take 1 + steps of them, the round's length serial
    p = PrefillPacer(-1, 2.0)
    p.beside = True
    p.stepped(0.002)
    p.prefilled(256, 256 * 5e-6)
    assert p.budget(decoding=True) == 1200  # (2 + 1) x 2 ms / 5 us


def test_it_follows_the_cost_as_the_context_grows():
    """Later chunks of a long prompt read more keys: the chunk shrinks as they cost more
    (no fixed part here: it settles where a chunk costs `steps` decode steps)."""
    p = PrefillPacer(-1, 1.0)
    p.stepped(0.008)
    sizes = []
    for per_token in (4e-6, 8e-6, 16e-6, 16e-6, 16e-6, 16e-6, 16e-6, 16e-6):
        n = p.budget(decoding=True)
        p.prefilled(n, n * per_token)
        sizes.append(p.budget(decoding=True))
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] in range(500, 600), sizes
    # a fixed 1 ms per forward plus 2 us a token: chunk time converges to one 4 ms step
    p = PrefillPacer(-1, 1.0)
    p.stepped(0.004)
    for _ in range(30):
        n = p.budget(decoding=True)
        p.prefilled(n, 0.001 + n * 2e-6)
    n = p.budget(decoding=True)
    assert abs((0.001 + n * 2e-6) - 0.004) < 0.0002, n


WIDTHS = (16, 64, 256, 512, 1024, 2048)  # the static engine's chunk widths on a GPU


def _admit(p: PrefillPacer, lengths, cost, step_s: float, spikes=()) -> list[tuple]:
    """Long prompts admitted one after another while others decode, as the runner and the
    static engine take them: each round the pacer's budget; the prompt's rest in whole where
    it fits (padded to the next chunk width: a prompt's last chunk), else the widest width
    within the budget; `cost(width, context)` seconds (twice that in rounds `spikes`); the
    pacer told what the runner tells it. Returns (width, seconds, context, ended) a round."""
    rounds = []
    for length in lengths:
        done = 0
        while done < length:
            p.stepped(step_s)
            budget = p.budget(decoding=True, context=done)
            rest = length - done
            if rest <= budget:
                take, w = rest, min(c for c in WIDTHS if c >= rest)
            else:
                take = w = max([c for c in WIDTHS if c <= budget] or [WIDTHS[0]])
            t = cost(w, done) * (2 if len(rounds) in spikes else 1)
            p.prefilled(take, t, budget, ended=take == rest, context=done)
            rounds.append((w, t, done, take == rest))
            done += take
    return rounds


def test_a_fixed_cost_per_forward_does_not_hold_chunks_at_the_narrowest_width():
    """Under CUDA graphs a chunk forward costs ~1.2 ms whatever its width plus ~3.3 us a token
    (the H200 at ~3k keys) next to a ~2 ms decode step. With 1.5 steps (3 ms) a 512-token
    chunk fits (2.9 ms) and a 1,024-token one does not (4.6 ms): the pacer must settle at 512.
    Sized by time per token alone, a 256-token chunk (2.0 ms, 7.8 us a token) asked for 384
    tokens, which the engine takes as 256 again: every long prompt went in 256 at a time (the
    thirteenth session's lease, 16 prompts of ~2,900 tokens). Bursts of short prompts before
    them (8 a forward: 480 tokens in two) and each prompt's padded last chunk (its rest, up
    to the next width) must not mislead it."""
    p = PrefillPacer(2048, 1.5)
    for _ in range(3):
        p.stepped(0.002)
    p.prefilled(240, 0.0014)
    p.prefilled(480, 0.0028)
    rounds = _admit(p, [2900] * 40, lambda w, ctx: 0.0012 + 3.3e-6 * w, 0.002)
    cut = [w for w, _, _, ended in rounds[40:] if not ended]
    assert cut.count(512) >= 0.9 * len(cut), cut
    # over the target: at most a few rounds but the prompts' padded last chunks
    over = [w for w, t, _, ended in rounds if t > 0.003 * 1.05 and not ended]
    assert len(over) <= 3, over
    # a cheaper step (fewer running requests) asks for less: 1.5 x 1.2 ms = 1.8 ms fits 256
    for _ in range(10):
        p.stepped(0.0012)
    assert p.budget(decoding=True) < 512
    # where the fixed part is small, the budget is what the step time buys in tokens
    p = PrefillPacer(2048, 1.5)
    rounds = _admit(p, [7200] * 10, lambda w, ctx: 1e-5 + 2.9e-6 * w, 0.002)
    assert [w for w, _, _, ended in rounds[-20:] if not ended][-10:] == [1024] * 10, rounds


COSTS = {  # a chunk of w tokens after ctx keys, seconds
    # the H200 at ~3k keys under graphs: 1.2 ms fixed + 3.3 us a token (512: 2.9 ms, 1,024: 4.6)
    "fixed": lambda w, ctx: 0.0012 + 3.3e-6 * w,
    # a later chunk reads more keys: 512 tokens take 2.4 ms at 0 keys, 3.3 at 7,000
    "context": lambda w, ctx: 0.0012 + w * (2.4e-6 + 0.25e-9 * ctx),
    # attention dominating: 1,024 fit at first, 256 at the end of a long prompt
    "steep": lambda w, ctx: 0.0008 + w * (1.5e-6 + 0.6e-9 * ctx),
}


@pytest.mark.parametrize("kind", sorted(COSTS))
def test_it_keeps_near_the_target_as_contexts_grow_with_noise_and_spikes(kind):
    """Prompts of 2,000-8,000 tokens one after another (each starts again at no keys), costs
    +-10% and one chunk in 50 twice its time (clamped): the chunks stay near the widest width
    that fits at their context (the best an engine that rounds to widths can do: the pacer
    has to find it by measuring) and rounds seldom take far over the target. The thirteenth
    session's pacer took 0.50 / 0.56 / 0.70x of the best here (fixed, context, steep), the
    same brackets blind to context 0.53 / 0.58 / 0.46x, with 1.5x clamps and a shorter
    memory 0.71x in "fixed" (one spike kept 512 out)."""
    import random

    rng = random.Random(3)
    target, base = 1.5 * 0.002, COSTS[kind]
    lengths = [rng.randint(2000, 8000) for _ in range(60)]
    p = PrefillPacer(2048, 1.5)
    rounds = _admit(
        p,
        lengths,
        lambda w, ctx: base(w, ctx) * rng.uniform(0.9, 1.1),
        0.002,
        spikes=set(range(7, 10_000, 50)),
    )
    cut = [(w, t, ctx) for w, t, ctx, ended in rounds if not ended]
    best = sum(max(c for c in WIDTHS if base(c, ctx) <= target) for _, _, ctx in cut)
    got = sum(w for w, _, _ in cut)
    assert 0.85 * best <= got <= 1.15 * best, (got, best)
    far = [round(t / target, 2) for _, t, _ in cut if t > 1.6 * target]
    assert len(far) <= 0.03 * len(cut), far  # the spikes (2%) and a few probes


def test_no_pacing_keeps_the_token_cap():
    p = PrefillPacer(2048, 0.0)
    p.stepped(0.002)
    p.prefilled(256, 1.0)
    assert p.budget(decoding=True) == 2048


def test_one_slow_step_does_not_let_a_whole_prompt_in():
    """A step that captures a graph or catches a drafter up counts as at most SPIKE x the
    average; a lasting change still comes through, round by round."""
    p = PrefillPacer(-1, 2.0)
    p.stepped(0.002)
    p.prefilled(64, 64 * 5e-6)
    before = p.budget(decoding=True)
    p.stepped(0.5)  # 250x the average
    assert p.budget(decoding=True) <= 2.5 * before
    for _ in range(20):
        p.stepped(0.02)  # the batch grew: steps are 10x longer from now on
    assert p.step_s == pytest.approx(0.02, rel=0.01)


def test_steps_beside_chunks_make_room_for_a_plain_step_now_and_then():
    """Beside a chunk a step is not timed as a plain one: until one was, and after REFRESH
    rounds in a row beside chunks, the pacer asks for a round without a chunk; its step
    brings the step time up to date (here: the batch grew, steps now take 5x as long)."""
    p = PrefillPacer(-1, 2.0)
    assert p.plain_due()  # no step timed yet
    p.stepped(0.002)
    p.prefilled(512, 0.004)
    before = p.budget(decoding=True)
    for i in range(REFRESH):
        assert not p.plain_due(), i
        p.stepped_beside()
    assert p.plain_due()
    for _ in range(8):
        p.stepped(0.01)
        assert not p.plain_due()
    assert p.budget(decoding=True) > before
