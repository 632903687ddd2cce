# For the thirty-second session, second lease: budget-0 rounds' feature buffer. s37 (this
# session's first, results/upkeep/h100-s37/) measured the graph catch-up: DFlash at budget 0
# went from 0.90-0.91x (s36) to 0.93-0.96x AR's tok/s on the H100. What is left: with a slot's
# buffer at one draft's rows (block 8 + 1), a 4-step budget-0 trip wrote the drafter's context
# every second trip. Now a slot buffers static_dflash.BUFFERED_ROWS (32) rows: a write every
# eighth trip. Side by side in one call: AR and DFlash b0 with the new buffer, b0 with the old
# (BUFFERED_ROWS 0), then b7 and adaptive (their drafts now read the buffer's first rows), at
# C=16/64, then the GPU tests of the changed paths. The new buffer's b0 runs first, on the
# fresh machine (s37's first run there was its slowest): any first-run cost is against it.
# Timeouts: the first engine on a fresh machine took 74 s to be ready (s37), later ones 10-35
# s; this session's trimmed call 3 gave two configs 115 s and one 85 s and got no result.
# The pieces are s37's (`PACK=1 bash bench/lease/s37.sh` here), carried the same way:
#   1  carry .carry/r1 .whl     (CALL=1 bash bench/lease/s38.sh)
#   2  carry .carry/r2
#   3  carry .carry/r3          (END=seconds: the GPU tests stop by then; 590 by default)
#   4  (no carry, at once after 3) the adaptive policy's start-up times, taken from calls of
#      4 rounds as its live samples are (static_startup.ROUND_TIMES_TRIPS, thirty-third
#      session), against one round a call (the old prior, which likely kept s37's adaptive
#      at the ceiling b15 at C=16 where fixed b7 was faster), fixed b7 beside, by_budget
case ${CALL:?} in
[12]) exec bash bench/lease/s37.sh ;;
esac
. bench/lease/load_env.sh
if [ "$CALL" = 4 ]; then
    echo '{"engine": {"ROUND_TIMES_TRIPS": false}}' >/tmp/old_prior.json
    timeout 200 python3 -m ddserve.bench.engine_load $LOAD --concurrency 16,64 \
        --configs dflash-b15k4@adaptive@steps4,dflash-b7k4@steps4 --name prior 2>&1 | quiet | table
    timeout 150 python3 -m ddserve.bench.tuned /tmp/old_prior.json ddserve.bench.engine_load \
        $LOAD --concurrency 16,64 --configs dflash-b15k4@adaptive@steps4 --name old_prior 2>&1 |
        quiet | table
    echo "done at ${SECONDS}s"
    exit 0
fi
echo '{"engine": {"BUFFERED_ROWS": 0}}' >/tmp/old.json
timeout 200 python3 -m ddserve.bench.engine_load $LOAD --concurrency 16,64 \
    --configs dflash-b0@steps4,ar@steps4 --name buffer 2>&1 | quiet | table
timeout 130 python3 -m ddserve.bench.tuned /tmp/old.json ddserve.bench.engine_load $LOAD \
    --concurrency 16,64 --configs dflash-b0@steps4 --name old_buffer 2>&1 | quiet | table
timeout 170 python3 -m ddserve.bench.engine_load $LOAD --concurrency 16,64 \
    --configs dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 --name buffer_drafting 2>&1 |
    quiet | table
timeout $((${END:-590} - SECONDS)) python3 -m pytest -q -p no:cacheprovider -k cuda \
    tests/engine/test_spec_steps.py tests/engine/test_static_engine.py 2>&1 |
    tail -4 | tee $OUT/gpu_tests.txt
echo "done at ${SECONDS}s"
