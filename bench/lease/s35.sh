# For the thirty-first session: where adaptive speculation loses to AR at 64 requests
# in-process (thirtieth session: 0.94x AR at 4 steps, the policy choosing budgets 3 and 7 in
# 631 of 669 rounds: per round it made 2.11x the tokens for 2.24x the time). Two suspects,
# side by side in one process: the DFlash engine's own budget-0 rounds (the drafter's upkeep:
# its feature rows buffered, its context written) against a drafter-free AR engine, and fixed
# budgets 3 and 7 end to end against the policy's per-round estimate. Then the GPU tests.
# `CALL=N bash bench/lease/s35.sh`, back to back:
#   1  carry .carry/r1 .whl   the GPU tests (tests/engine -k cuda; the admission ones need
#                             the GGUF: call 3 runs them)
#   2  carry .carry/r2
#   3  carry .carry/r3        load levels C=16/64, 16 waves, first-token share 0.5: AR at 4
#                             steps, dflash-b0/b3k4/b7k4 at 4 steps, adaptive b15/k4 at 4 steps;
#                             then the admission GPU tests
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
case ${CALL:?} in
1)
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/engine -k "cuda and not long_prompt_is_admitted" 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
2) ls -la /root/parts | tail -2 ;;
3)
    timeout 420 python3 -m ddserve.bench.engine_load --device cuda \
        --configs ar@steps4,dflash-b0@steps4,dflash-b3k4@steps4,dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 \
        --concurrency 16,64 --requests 32 --waves 16 --max-tokens 128 --prompt-set heldout:16 \
        --first-token-share 0.5 --name upkeep --out $OUT 2>&1 | quiet |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" -e Error | cut -c1-140
    timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging \
        tests/engine/test_static_engine.py -k "long_prompt_is_admitted and cuda" 2>&1 |
        grep -E "^E |passed|failed" | head -8 | tee $OUT/gpu_tests_admission.txt
    ;;
esac
echo "done at ${SECONDS}s"
