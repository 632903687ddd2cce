# For the thirty-second session: the DFlash engine's budget-0 upkeep, mended. The thirty-first
# found (results/upkeep/): DFlash at budget 0 makes 0.86-0.91x AR's tok/s at C=16/64 (H200 and
# H100), and its loss is inside step_batch; under cProfile at C=64 the newcomers' drafter
# context writes (a newcomer or two a round, ~40 eager launches each) took ~10% of the
# worker's time. They are now one CUDA graph per padded size (StaticDFlash.extend_many),
# captured at warm-up. Side by side in one call: the old eager write (BATCHED_CATCH_UP off)
# against the graph, DFlash b0; then AR, b0, b7 and adaptive at C=1/2/16/64; then the GPU
# tests in the time left.
# `CALL=N bash bench/lease/s37.sh`, back to back:
#   1  carry .carry/r1 .whl
#   2  carry .carry/r2
#   3  carry .carry/r3
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
table() { grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" -e Error | cut -c1-140; }
LOAD="--device cuda --requests 32 --waves 16 --max-tokens 128 --prompt-set heldout:16 --first-token-share 0.5 --out $OUT"
case ${CALL:?} in
[12]) ls -la /root/parts | tail -2 ;;
3)
    echo '{"engine": {"BATCHED_CATCH_UP": false}}' >/tmp/old.json
    timeout 150 python3 -m ddserve.bench.tuned /tmp/old.json ddserve.bench.engine_load $LOAD \
        --concurrency 16,64 --configs dflash-b0@steps4 --name old_catch_up 2>&1 | quiet | table
    timeout 300 python3 -m ddserve.bench.engine_load $LOAD --concurrency 1,2,16,64 \
        --configs ar@steps4,dflash-b0@steps4,dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 \
        --name catch_up 2>&1 | quiet | table
    timeout $((590 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/engine -k cuda 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
esac
echo "done at ${SECONDS}s"
