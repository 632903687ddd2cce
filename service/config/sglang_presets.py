"""How SGLang builds take the DDTree parameters: named presets of flags and variables.

SGLang's DDTree is not merged upstream, and the builds in use name its knobs differently:

  preset            --speculative-algorithm  budget                        topk                               window
  upstream-0.5.23   DFLASH                   (none: a DFlash chain)        (none)                             --speculative-draft-window-size
  sglang-pr-29907   DDTREE                   --speculative-ddtree-budget   env SGLANG_DDTREE_MAX_TOPK (a cap) --speculative-draft-window-size
  seed-fork         DFLASH                   --speculative-ddtree-budget   --speculative-ddtree-topk          --speculative-dflash-draft-window-size

* upstream-0.5.23: every flag is checked against SGLang 0.5.23's own parser
  (tests/test_sglang_launcher.py). 0.5.23 has no DDTree: budget and topk are not passed.
* sglang-pr-29907 (https://github.com/sgl-project/sglang/pull/29907, open): the PR's
  description lists `--speculative-algorithm DDTREE`, `--speculative-ddtree-budget` and the
  variables SGLANG_DDTREE_MAX_TOPK, SGLANG_DDTREE_DEPTH_BONUS, SGLANG_DDTREE_RANK_PROBE; the
  DDTree worker reuses DFlashWorkerV2, whose window flag is upstream's. In DDTree trees built
  from that code the candidates per depth are min(max(budget // L + 1, 2), V, MAX_TOPK), so
  our `topk` is an upper bound there, not the exact width. The budget flag is not in 0.5.23
  and is unverified against the PR branch's own server_args.py (not found in our code index).
* seed-fork: the fork the seed deployment ran (ddserve's earlier default flag names; the
  window flag is the pre-rename DFlash name). None of its three flags is in 0.5.23.

`SGLangConfig.preset` picks one; without a preset, `speculative_algorithm`, `ddtree_flags` and
`ddtree_env` spell the mapping out (another fork).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the live parameters a build may take at launch (sampling defaults are applied per request)
TREE_PARAMS = ("budget", "topk", "window")
UPSTREAM_WINDOW_FLAG = "--speculative-draft-window-size"


@dataclass(frozen=True)
class DDTreeMapping:
    """One build's names: the algorithm, and each tree parameter as a flag or a variable."""

    algorithm: str
    flags: dict[str, str] = field(default_factory=dict)  # budget/topk/window -> --flag
    env: dict[str, str] = field(default_factory=dict)  # budget/topk/window -> VARIABLE


PRESETS: dict[str, DDTreeMapping] = {
    "upstream-0.5.23": DDTreeMapping("DFLASH", {"window": UPSTREAM_WINDOW_FLAG}),
    "sglang-pr-29907": DDTreeMapping(
        "DDTREE",
        {"budget": "--speculative-ddtree-budget", "window": UPSTREAM_WINDOW_FLAG},
        {"topk": "SGLANG_DDTREE_MAX_TOPK"},
    ),
    "seed-fork": DDTreeMapping(
        "DFLASH",
        {
            "budget": "--speculative-ddtree-budget",
            "topk": "--speculative-ddtree-topk",
            "window": "--speculative-dflash-draft-window-size",
        },
    ),
}
