# For the thirty-first session: the DFlash engine's upkeep at budget 0 and adaptive's cost over
# fixed b7 at 64 requests (s35 on an H200: AR 30.3k, DFlash b0 27.1k (0.89x), b7 30.9k,
# adaptive b15 26.5k tok/s). Suspect one: every newcomer's drafter context written by its own
# `extend` (a few dozen launches each, 64 a wave): now one write a round (BATCHED_CATCH_UP),
# side by side with the old path. Suspect two, measured: where adaptive's wall time goes
# (step_batch, the policy, the runner's rest, graphs captured mid-level, cProfile's top).
# `CALL=N bash bench/lease/s36.sh`, back to back:
#   1  carry .carry/r1 .whl
#   2  carry .carry/r2
#   3  carry .carry/r3        16 waves, share 0.5: old catch-up (b0, adaptive; C=64), new (AR, b0,
#                             b7, adaptive; C=16/64), then adaptive under cProfile at C=64;
#                             then the GPU tests (tests/engine -k cuda) in the time left
. bench/lease/load_env.sh
case ${CALL:?} in
[12]) ls -la /root/parts | tail -2 ;;
3)
    echo '{"engine": {"BATCHED_CATCH_UP": false}}' >/tmp/old.json
    timeout 100 python3 -m ddserve.bench.tuned /tmp/old.json ddserve.bench.engine_load $LOAD \
        --concurrency 64 --configs dflash-b0@steps4,dflash-b15k4@adaptive@steps4 \
        --name old_catch_up 2>&1 | quiet | table
    timeout 200 python3 -m ddserve.bench.engine_load $LOAD --concurrency 16,64 \
        --configs ar@steps4,dflash-b0@steps4,dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 \
        --name catch_up 2>&1 | quiet | table
    timeout 80 python3 -m ddserve.bench.engine_load $LOAD --concurrency 64 --profile \
        --configs dflash-b15k4@adaptive@steps4 --name profiled 2>&1 | quiet | table
    timeout $((590 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/engine -k cuda 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
esac
echo "done at ${SECONDS}s"
