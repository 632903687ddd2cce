# For the next lease, what the eleventh session left unmeasured (issue 17, then issue 14).
# Calls 1-2 are `CALL=1`/`CALL=2` of this script (carrying `.whl` + `.carry/q1`, then
# `.carry/q2`); call 3 carries `.carry/q3` (the GGUF joined). Pieces of Ray's wheel carried
# beside them (`.carry/r1`, bench/lease/ray_asc.sh) are kept for a later call.
#   1: GPU tests of the fused layers and the attention (the PDL chain test as the review
#      strengthened it: cos/sin made in the graph, inputs varying per replay, the split
#      merge), then verify steps compiled / fused-plain / fused after cos/sin moved back
#      after the wait
#   2: the kernels one by one at 1 row
#   3: fp32 greedy through the fused kernels against torch's layers on real weights; C=1
#      decode fused vs torch; issue 14's levels with the adaptive ceiling at b15/k4 (a
#      16-row verify: the fused layers) beside b16/k4 (32 wide: torch's)
mkdir -p /root/parts /root/res
cp .carry/q?/* .carry/r?/* /root/parts/ 2>/dev/null  # whatever pieces this call carried
. bench/device_env.sh /root/parts
R=/root/res
if [ "${CALL:-3}" = 1 ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_attention.py > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
    grep -E "^FAILED|^ERROR" $R/gpu_tests.txt | head -5
    timeout 200 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,4,16 \
        --widths 1,2,8,16 --attention triton --modes compile,fused-plain,fused \
        --name step --out $R 2>&1 | grep -E " gpu "
elif [ "${CALL:-3}" = 2 ]; then
    timeout 240 python3 -m ddserve.bench.layer_kernels --rows 1 --name lk1 --out $R 2>&1 | grep -E "best|per layer"
else
    timeout 200 python3 -m ddserve.bench.engine_cpu --device cuda --dtype float32 \
        --prompt-set heldout:8 --max-tokens 96 --configs ar,ar@fused,dflash-b15k4@fused \
        --sampled-configs "" --no-server --name fused_fp32 --out $R 2>&1 | grep -v Warn | tail -6
    tar czf $OUT/res.tgz -C /root res
    timeout 300 python3 -m ddserve.bench.engine_load --device cuda \
        --configs ar,dflash-b15k4@adaptive,dflash-b16k4@adaptive --concurrency 1,2,16,64 \
        --requests 32 --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-levels \
        --out $R 2>&1 | grep -v Warn | tail -14
fi
tar czf $OUT/res.tgz -C /root res
