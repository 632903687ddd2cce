# Thirteenth session: one H200 lease of five calls back to back (the machine stays warm 30 s
# after a call; each call carries at most 64 MiB with the tree). `CALL=N bash bench/lease/s13.sh`:
#   1  carry .whl .carry/q1   GPU tests (fused layers, attention, the static engine's CUDA
#                             tests), bench.pdl_check (issue 17: why the PDL chain's test failed)
#   2  carry .carry/q2        verify steps: compiled, fused plain, fused with PDL + prefetch
#   3  carry .carry/q3 .carry/r1   issue 14's load levels with C=4 (AR, adaptive b16/k4)
#   4  carry .carry/r2        issue 18: C=16 at ~30 and ~2,900 tokens, paced and capped, with
#                             the scheduler's log line every 40 rounds (where the rounds go)
#   5  carry .carry/r3        issue 13: the serving path, in-process and `ddserve up` with 4 API
#                             processes (ITL p99 after the metrics relay's slicing)
mkdir -p /root/parts /root/res
cp .carry/q?/* .carry/r?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
quiet() { grep -v -E 'Warn|transformers|^ *$'; }
case ${CALL:?} in
1)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_attention.py tests/engine/test_static_engine.py -k "cuda or triton or pdl or attention" \
        > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
    grep -E "^FAILED|^ERROR" $R/gpu_tests.txt | head -8
    timeout 200 python3 -m ddserve.bench.pdl_check --out $R/pdl_check.json 2>&1 | quiet | tail -20
    ;;
2)
    timeout 200 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,4,16 \
        --widths 1,16 --attention triton --modes compile,fused-plain,fused-overlap \
        --name step --out $R 2>&1 | grep -E " gpu "
    ;;
3)
    timeout 420 python3 -m ddserve.bench.engine_load --device cuda \
        --configs ar,dflash-b16k4@adaptive --concurrency 1,2,4,16,64 \
        --requests 32 --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-levels \
        --out $R 2>&1 | quiet | tail -12
    ;;
4)
    ADMIT=0 LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 420 bash bench/long_context.sh $R/lc16 paced capped \
        2>&1 | quiet | tail -8
    grep -h "Decode batch" $R/lc16/*-engine.log | tail -30 | cut -c 1-400
    ;;
5)
    . bench/device_ray.sh
    LEVELS=1,16,64 REQ=256 BUDGETS=0 PROMPTS=chat MAXB=64 timeout 500 bash bench/serving_path.sh \
        $R/path inproc ray-asc 2>&1 | quiet | tail -10
    python3 -m ddserve.bench.serving_path_report $R/path 2>&1 | quiet | tail -7
    rm -f $R/*/*.png
    ;;
esac
tar czf $OUT/res$CALL.tgz -C /root res
