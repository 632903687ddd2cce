"""The chunk a round prefills while others decode (ddserve.engine.prefill_pacing): sized from
measured decode steps and prefill speed, within the token cap; an idle engine prefills whole."""

import pytest

from ddserve.engine.prefill_pacing import FIRST_TOKENS, MIN_TOKENS, PrefillPacer


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
    """Later chunks of a long prompt read more keys: the chunk shrinks as they cost more;
    a cost per token that falls with larger chunks lets it grow back (it settles where a
    chunk costs `steps` decode steps)."""
    p = PrefillPacer(-1, 1.0)
    p.stepped(0.008)
    sizes = []
    for per_token in (4e-6, 8e-6, 16e-6, 16e-6, 16e-6):
        n = p.budget(decoding=True)
        p.prefilled(n, n * per_token)
        sizes.append(p.budget(decoding=True))
    assert sizes[0] > sizes[1] > sizes[2] > sizes[-1] and sizes[-1] in range(500, 600)
    # a fixed 1 ms per forward plus 2 us a token: chunk time converges to one 4 ms step
    p = PrefillPacer(-1, 1.0)
    p.stepped(0.004)
    for _ in range(30):
        n = p.budget(decoding=True)
        p.prefilled(n, 0.001 + n * 2e-6)
    n = p.budget(decoding=True)
    assert abs((0.001 + n * 2e-6) - 0.004) < 0.0002, n


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
