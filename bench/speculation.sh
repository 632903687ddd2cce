#!/usr/bin/env bash
# Speculation that pays (issue 14), side by side in one run on one GPU: the GPU tests of the
# new paths, then the in-process runner (python -m ddserve.bench.engine_load) for
#   ar                     plain decoding (budget 0, no drafter)
#   dflash-b16k4@hosttree  DDTree, trees built on the host (the engine before this change)
#   dflash-b16k4           DDTree, trees built on the GPU (tree_triton), one sync per round
#   dflash-b16k4@adaptive  the same with --speculative-adaptive (budget 16 the ceiling)
# at C=1/2/4/16/64, T=0 (and T=1 at C=1/2), on the 16 held-out prompts (8 chat + 8 HumanEval),
# 128-token answers; then fp32 greedy through each config == AR token for token
# (python -m ddserve.bench.engine_cpu --dtype float32).
#
#   bench/speculation.sh OUT [tests] [load] [sampled] [lossless]
# env: PY (python3), DEVICE (cuda), TOKENS (128), DFLASH (a drafter directory; default the builtin one), LEVELS, REQ (32), WAVES (8: requests per level >= WAVES x C),
#      CONFIGS (the four above), TAG (prefix of the result names), LOSSLESS_CONFIGS (the fp32 part's)
set -u
out=$1
shift
parts=${*:-tests load sampled lossless}
py=${PY:-python3}
device=${DEVICE:-cuda}
tokens=${TOKENS:-128}
levels=${LEVELS:-1,2,4,16,64}
req=${REQ:-32}
waves=${WAVES:-8}
tag=${TAG:-spec}
configs=${CONFIGS:-ar,dflash-b16k4@hosttree,dflash-b16k4,dflash-b16k4@adaptive}
dflash=()
[ -n "${DFLASH:-}" ] && dflash=(--dflash-path "$DFLASH")
mkdir -p "$out"
for part in $parts; do
    SECONDS=0
    case $part in
    tests)
        $py -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
            "tests/engine/test_static_engine.py::test_graphs_equal_reference_cuda_fp32" \
            "tests/engine/test_static_engine.py::test_logprobs_and_logit_bias_in_mixed_batches" \
            >"$out/$tag-tests.log" 2>&1
        tail -3 "$out/$tag-tests.log"
        ;;
    load)
        $py -m ddserve.bench.engine_load --device $device --configs "$configs" "${dflash[@]}" \
            --concurrency "$levels" --requests "$req" --waves "$waves" --max-tokens $tokens --prompt-set heldout:16 \
            --name "$tag-load" --out "$out" 2>&1 | grep -v Warning
        ;;
    sampled)
        $py -m ddserve.bench.engine_load --device $device --configs "${configs/dflash-b16k4@hosttree,/}" \
            "${dflash[@]}" --concurrency 1,2 --requests "$req" --waves "$waves" --max-tokens $tokens \
            --prompt-set heldout:16 --temperature 1 --name "$tag-t1" --out "$out" 2>&1 | grep -v Warning
        ;;
    lossless)
        dl=()
        [ -n "${DFLASH:-}" ] && dl=(--dflash "$DFLASH")
        $py -m ddserve.bench.engine_cpu --device $device --dtype float32 --prompt-set heldout:16 \
            --max-tokens $tokens --configs ${LOSSLESS_CONFIGS:-ar,dflash-b16k4,dflash-b8k2,dflash-b4k1} --sampled-configs "" \
            "${dl[@]}" --no-server --name "$tag-fp32" --out "$out" 2>&1 | grep -v Warning | tail -8
        ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
    echo "$part: ${SECONDS}s"
done
