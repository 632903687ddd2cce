"""Adaptive speculation: each round's draft budget follows the live batch.

With `--speculative-adaptive` the live `budget` is a ceiling. The candidates of a round are 0
(no draft: the root alone, plain autoregressive) and the budgets that fill a verify width
(1, 3, 7, 15, ... below the ceiling) and the ceiling itself. A small batch is bound by the
launches and weight reads of a step, so a bigger tree is nearly free and each accepted token
saves a step; a big batch is bound by the verify's arithmetic, so every drafted node costs
compute and speculation loses. Where the crossover lies depends on the model, the drafter,
the GPU and the prompts, so it is measured, not configured:

  * time[bucket, b]: the wall time of a round of `b` at a batch of that size bucket (the
    rows the round verifies, which the runner tells: the static engine's forward covers
    slots 0..used_rows-1; rounded up to a power of two as its graphs are), an exponential average
    of the rounds themselves (a sample is clipped at 2x the estimate, so a one-off stall
    such as a graph captured on first use does not poison it), taken from full calls only
    (with --num-scheduler-steps N, calls of as many rounds as that budget's calls have run,
    N where the engine runs several rounds a call: a call's host round trip falls on each of
    a short call's few rounds, which would make a candidate re-tried there look slow);
  * gain(b): tokens a request gets per round at `b` (1 at budget 0), the same for every
    batch size (acceptance depends on the drafter and the text, not the batch). A best-first
    tree of budget b is the first b nodes of every bigger one, so one round at budget B says
    what every candidate b <= B would have given: a request whose accepted path is nodes
    n1 < n2 < ... gets 1 + #{n_i <= b} tokens. The policy averages the increments between
    consecutive candidates, inc[b] = #{prev(b) < n_i <= b}, each from every drafting round
    whose budget reaches b, and gain(b) = 1 + the increments up to b: candidates share
    their common part, so their differences (which decide) carry little of a round's noise
    (a single request's token count varies from 1 to depth + 1), gains never fall with b,
    and a round at 7 refreshes what 16 shares with it. (A DFlash drafter drafts its whole
    block at every budget, so a smaller tree is exactly the bigger one's first nodes; a
    drafter that drafts `budget` deep would have drafted a shorter one: an estimate there.)

A round picks the candidate with the most tokens per second, gain(b) / time[bucket, b].
The engine's start-up cost model (`prior`: real rounds of every candidate at every batch
bucket, on throw-away prompts, StaticEngine.round_times) gives every time a first estimate,
so a batch bucket met for the first time needs no rounds of its own to choose; gains come
from live rounds only, so until a candidate's is known the largest such is drafted (at most
twice at a batch size: its round teaches every smaller one's), and the ceiling drafts until
every increment has seen GAIN_WARM requests (each is a plain mean over its first 200: at one
request a round, a first sample that stood for ~50 rounds once kept the H200 at budget 3
for half a C=1 level, 1.25x AR where b16 made 1.49x). Without a prior, at a new batch bucket every
candidate runs twice first (the first round of a shape may pay
for warming it up: its time is replaced by the second's); after that another candidate is
re-tried every `interval` rounds of that bucket, an interval that doubles while the best
holds (16 .. 1024 rounds) and starts over when it changes: the best that just lost, else
every other time the ceiling (its round refreshes every gain), else each in turn, skipping
those both far behind and expensive (a 17-node tree at 64 requests). A re-try's sample
weighs more (its estimate may be old). So the policy follows a changing workload while
exploring under 1% of rounds once settled. `SpecPolicy` is plain arithmetic over what
`record` is told: no clock, no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

ALPHA = 0.1  # weight of a round's time in its average
GAIN_ALPHA = 0.005  # weight of one request's tokens in the gains (a round of n: 1 - 0.995**n)
# (~200 requests' memory: at a few requests a trip of 4 rounds, 0.02's ~50 let a run of
# unlucky rounds settle the policy on a budget up to 8% slower; a workload that changes is
# still followed within ~200 requests' rounds, a fraction of a second on a GPU)
# ... or more while an increment has seen few requests: each of its first 1 / GAIN_ALPHA
# counts alike (a plain mean), so one request's unlucky first round (1 token where 2.5 is
# usual) does not stand for ~200 rounds; and until the ceiling's increments have seen
# GAIN_WARM requests, rounds draft at the ceiling (it teaches every candidate's gain)
GAIN_WARM = 16
# a re-try's sample, whose estimate may be many rounds old: it replaces the time (rounds
# of one shape vary little) and weighs half in the gain (a round's acceptance varies a lot)
RETRY_TIME_ALPHA, RETRY_GAIN_ALPHA = 1.0, 0.5
CLIP = 2.0  # a time sample counts at most CLIP x the current estimate
EXPLORE_MIN, EXPLORE_MAX = 16, 1024  # rounds between re-tries of another candidate
FIRST_SAMPLES = 2  # rounds of each candidate at a new batch size; the first one is dropped
# time a round from full calls only (as many rounds as the budget's calls have run: N of
# --num-scheduler-steps where the engine runs several a call, 1 where it cannot): a call of
# fewer (a newcomer's first token, a prompt joining, a request's last tokens) carries its
# whole host round trip on each of its rounds; timed alike, a candidate re-tried on such a
# call looked ~20% slower than it is, so the budget in use stayed (s38, H100 C=16: adaptive
# kept b15 at 0.91x fixed b7's tok/s). False: every call's rounds time (before 2026-12-07)
FULL_TRIPS_ONLY = True


def candidates(ceiling: int) -> list[int]:
    """0, the budgets that fill a verify width (2**j - 1) below `ceiling`, and `ceiling`."""
    out, b = [0], 1
    while b < ceiling:
        out.append(b)
        b = 2 * b + 1
    if ceiling > 0:
        out.append(ceiling)
    return out


def size_bucket(batch: int) -> int:
    b = 1
    while b < batch:
        b *= 2
    return b


@dataclass
class _Bucket:
    rounds: int = 0
    best: int | None = None
    interval: int = EXPLORE_MIN
    next_explore: int = EXPLORE_MIN
    previous: int | None = None  # the best before the last change: re-tried first
    cursor: int = 0  # re-tries so far: the ceiling every other one, else round-robin
    trying: int | None = None  # the budget being re-tried this round


@dataclass
class SpecPolicy:
    time: dict[tuple[int, int], float] = field(default_factory=dict)
    inc: dict[int, float] = field(default_factory=dict)  # candidate -> its increment
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)  # candidate -> requests its inc saw
    samples: dict[tuple[int, int], int] = field(default_factory=dict)
    tries: dict[tuple[int, int], int] = field(default_factory=dict)  # rounds, ok or not
    failures: set[tuple[int, int]] = field(default_factory=set)  # (bucket, budget) that raised
    most: dict[int, int] = field(default_factory=dict)  # budget -> the most rounds a call ran

    def prior(self, batch: int, budget: int, seconds: float) -> None:
        """A start-up measurement of a round of `budget` at `batch` requests: its first time
        estimate there, worth the first samples (live rounds then average into it)."""
        key = (size_bucket(batch), budget)
        self.time[key] = seconds
        self.samples[key] = max(self.samples.get(key, 0), FIRST_SAMPLES)

    def choose(self, batch: int, ceiling: int, full: bool = True) -> int:
        """The budget of a round of `batch` requests under the live ceiling; `full`: its call
        is planned at the engine's full count of rounds (only such calls re-try other
        candidates: their times are taken from full calls)."""
        cands = candidates(ceiling)
        if len(cands) == 1:
            return cands[0]
        key = size_bucket(batch)
        for b in cands:  # measure every candidate at this size first
            if self.samples.get((key, b), 0) < FIRST_SAMPLES:
                return b
        # gains come from drafting rounds: the largest candidate not yet known, a few times
        # at each batch size (one that fails at 64 requests may work at 1)
        unknown = [
            b for b in cands if not self.known(b) and self.tries.get((key, b), 0) < FIRST_SAMPLES
        ]
        if unknown:
            return unknown[-1]
        if (
            self.known(ceiling)
            and min(self.seen.get(b, 0) for b in cands[1:]) < GAIN_WARM
            and (key, ceiling) not in self.failures
        ):
            return ceiling  # the gains' first requests: the round that teaches them all
        # those whose rounds never succeeded anywhere have no gain: not candidates here
        cands = [b for b in cands if self.known(b)] or [0]
        st = self.buckets.setdefault(key, _Bucket())
        best = max(cands, key=lambda b: self.rate(key, b))
        if FULL_TRIPS_ONLY and not full:  # its time would not count: no re-try here
            st.trying = None
            return best
        st.rounds += 1
        if best != st.best:
            st.previous, st.best, st.interval = st.best, best, EXPLORE_MIN
            st.next_explore = st.rounds + st.interval
        st.trying = None
        if st.rounds < st.next_explore:
            return best
        st.interval = min(2 * st.interval, EXPLORE_MAX)
        st.next_explore = st.rounds + st.interval
        # re-try candidates that may be the best after all: close behind, or cheap enough that
        # a stale estimate costs little to check (a far-behind big tree at a big batch is not)
        others = [
            b
            for b in cands
            if b != best
            and (
                self.rate(key, b) > 0.5 * self.rate(key, best)
                or self.time[(key, b)] <= 2 * self.time[(key, best)]
            )
        ] or [b for b in cands if b != best]
        if not others:  # budget 0 alone (every drafting budget failed): nothing to re-try
            return best
        st.cursor += 1
        if st.previous in others:  # the one that just lost: it may have lost to noise
            st.trying, st.previous = st.previous, None
        elif st.cursor % 2 and ceiling in others:  # every other re-try: the ceiling, whose
            st.trying = ceiling  # round refreshes every candidate's gain
        else:
            st.trying = others[(st.cursor // 2) % len(others)]
        return st.trying

    def rate(self, key: int, budget: int) -> float:
        """Estimated tokens per second per request of a round of `budget` at bucket `key`."""
        return self.gain(budget) / self.time[(key, budget)]

    def known(self, budget: int) -> bool:
        return all(b in self.inc for b in candidates(budget)[1:])

    def gain(self, budget: int) -> float:
        """Estimated tokens a request gets from a round at `budget`."""
        return 1.0 + sum(self.inc[b] for b in candidates(budget)[1:])

    def record(
        self, batch: int, budget: int, seconds: float, paths: list[list[int]], rounds: int = 1
    ) -> None:
        """What a round of `batch` requests at `budget` took (its call's time over the
        `rounds` it ran), and the accepted paths (node indices, ascending) of the requests it
        served. A call of fewer rounds than that budget's calls have run times it only among
        a candidate's first samples."""
        key = (size_bucket(batch), budget)
        self.tries[key] = self.tries.get(key, 0) + 1
        st = self.buckets.get(key[0])
        retry = st is not None and st.trying == budget
        most = self.most[budget] = max(self.most.get(budget, 0), rounds)
        full = rounds >= most
        if full or not FULL_TRIPS_ONLY or self.samples.get(key, 0) < FIRST_SAMPLES:
            n = self.samples[key] = self.samples.get(key, 0) + 1
            a = RETRY_TIME_ALPHA if retry or n <= FIRST_SAMPLES else ALPHA
            old = self.time.get(key)
            self.time[key] = seconds if old is None else _avg(old, min(seconds, CLIP * old), a)
        if budget <= 0 or not paths:
            return
        n = len(paths)
        a = RETRY_GAIN_ALPHA if retry else 1 - (1 - GAIN_ALPHA) ** n
        cands = candidates(budget)
        # what each step up would add: the accepted nodes in (previous candidate, b], counted
        # in one pass (node i falls in the step up to cands[bisect_left(cands, i)])
        counts = [0] * len(cands)
        for p in paths:
            for i in p:
                if 0 < i <= budget:
                    counts[bisect_left(cands, i)] += 1
        for j, b in enumerate(cands[1:], 1):
            got = counts[j] / n
            old, seen = self.inc.get(b), self.seen.get(b, 0)
            # a plain mean over its first requests, then the moving average
            self.inc[b] = got if old is None else _avg(old, got, max(a, n / (seen + n)))
            self.seen[b] = seen + n

    def failed(self, batch: int, budget: int) -> None:
        """A round of `budget` that raised (the runner retried its requests one by one): a
        sample that makes it the slowest candidate of its bucket, so a budget that always
        fails (out of memory, say) is not chosen over and over; a later re-try measures it."""
        key = (size_bucket(batch), budget)
        self.samples[key] = self.samples.get(key, 0) + 1
        self.tries[key] = self.tries.get(key, 0) + 1
        self.failures.add(key)  # never again the gains' warm-up round at this bucket
        times = [t for (k, _), t in self.time.items() if k == key[0]]
        self.time[key] = CLIP * max(times + [self.time.get(key, 0.0), 1e-3])

    def snapshot(self) -> dict:
        """The estimates, for logs and benchmarks: {bucket: {budget: tok/s per request}}."""
        out: dict[int, dict[int, float]] = {}
        for (key, b), t in sorted(self.time.items()):
            if self.known(b):
                out.setdefault(key, {})[b] = round(self.gain(b) / t, 1)
        return out


def _avg(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new
