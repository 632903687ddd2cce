"""The chunk a round prefills while others decode (ddserve.engine.prefill_pacing): sized from
measured decode steps and prefill speed, within the token cap; an idle engine prefills whole."""

import pytest

from ddserve.engine.prefill_pacing import FIRST_TOKENS, MIN_TOKENS, STALE, PrefillPacer


def test_an_idle_engine_prefills_whole_and_the_cap_holds_before_any_measurement():
    p = PrefillPacer(2048, 2.0)
    assert p.budget(decoding=False) is None
    assert p.budget(decoding=True) == 2048  # no step measured yet: the token cap
    p.stepped(0.002)
    assert p.budget(decoding=True) == FIRST_TOKENS  # no chunk measured yet
    assert PrefillPacer(-1, 2.0).budget(decoding=True) is None  # no cap, nothing measured


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
    p.prefilled(256, 0.5)  # prefill far slower than a step (a CPU): short prompts stay whole
    p.prefilled(256, 0.5)
    assert p.budget(decoding=True) == MIN_TOKENS


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


def _paced_chunks(p: PrefillPacer, cost, rounds: int = 40) -> list[int]:
    """The chunks a long prompt goes in by, as the static engine takes them: the widest chunk
    width within the round's budget (StaticEngine._prefill_rows), costing cost(width)."""
    taken = []
    for _ in range(rounds):
        budget = p.budget(decoding=True)
        w = max([c for c in WIDTHS if c <= budget] or [WIDTHS[0]])
        if 2 * w >= budget:  # as the runner: only chunks that filled most of their budget
            p.prefilled(w, cost(w))
        taken.append(w)
    return taken


def test_a_fixed_cost_per_forward_does_not_hold_chunks_at_the_narrowest_width():
    """Under CUDA graphs a chunk forward costs ~1.2 ms whatever its width plus ~3.3 us a token
    (the H200 at ~3k keys) next to a ~2 ms decode step. With 1.5 steps (3 ms) a 512-token
    chunk fits (2.9 ms) and a 1,024-token one does not (4.6 ms): the pacer must settle at 512.
    Sized by time per token alone, a 256-token chunk (2.0 ms, 7.8 us a token) asked for 384
    tokens, which the engine takes as 256 again: every long prompt went in 256 at a time (the
    thirteenth session's lease). Before the long prompts, bursts of short ones (8 prompts a
    forward: 480 tokens in two) were measured too, and must not mislead it."""
    p = PrefillPacer(2048, 1.5)
    for _ in range(3):
        p.stepped(0.002)
    p.prefilled(240, 0.0014)
    p.prefilled(480, 0.0028)
    cost = lambda n: 0.0012 + 3.3e-6 * n  # noqa: E731
    taken = _paced_chunks(p, cost)
    assert taken[-20:] == [512] * 20, taken
    # one chunk over the target: the one that found where it lies (at most 2x the target)
    over = [w for w in taken if cost(w) > 0.003]
    assert over == [1024], taken
    # a cheaper step (fewer running requests) asks for less: 1.5 x 1.2 ms = 1.8 ms fits 256
    for _ in range(10):
        p.stepped(0.0012)
    assert _paced_chunks(p, cost, 10)[-5:] == [256] * 5
    # where the fixed part is small, the budget is what the step time buys in tokens
    p = PrefillPacer(2048, 1.5)
    p.stepped(0.002)
    assert _paced_chunks(p, lambda n: 1e-5 + 2.9e-6 * n)[-10:] == [1024] * 10


def test_a_size_not_measured_lately_is_measured_again():
    """Costs change (contexts, loads): a size that fitted is dropped after STALE chunks of
    other sizes, one that did not after 4x as many; then it is tried again, once."""
    p = PrefillPacer(2048, 1.0)
    p.stepped(0.003)
    cost = lambda n: 0.0012 + 3.3e-6 * n  # noqa: E731  (512: 2.9 ms fits; 1,024 does not)
    taken = _paced_chunks(p, cost, 4 * STALE + 20)
    assert taken.count(1024) == 2, taken  # the first probe, and one after 4 x STALE chunks
    # the step got slower (more requests running): larger chunks fit now, and are found
    for _ in range(10):
        p.stepped(0.006)
    assert _paced_chunks(p, cost, 10)[-5:] == [1024] * 5


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
