# Twenty-ninth session: whether the mend of adaptive speculation's non-finite logits on a GPU
# holds (twenty-eighth session, H100, bf16: 18/32 requests at C=1, 32/32 at C=2; fixed b15/k4
# none; the mend: the split-K counters made outside every graph capture, static.GraphCache),
# then the load levels again. One lease, calls back to back on one machine (it goes back 30 s
# after a call). `CALL=N bash bench/lease/s31.sh`:
#   1  carry .whl .carry/r1   random SmolLM2 weights (no GGUF yet): the GPU tests (counters
#                   zero whatever graph replays; budgets changing in bf16, B 1 and 2), then
#                   bench.nonfinite_probe mended against the defect back (capture_in_pool.json:
#                   the counters made in the capture, as before), mended at 4 rounds a trip;
#                   with ALL=1 also each other
#                   suspect out (split-K off, sdpa attention, torch's layers, no graphs)
#   2  carry .carry/r2        the GGUF's second part
#   3  carry .carry/r3        the same probe on the real weights, mended and not (ALL=1: the
#                   other variants too)
#   4  (nothing)              load levels through the in-process runner (C 1/2/16/64, 128
#                   tokens, ignore_eos): AR 1 / 4 steps, b15/k4 fixed at 4 rounds a trip,
#                   adaptive at 4 (LOAD; VARIANT: a bench.tuned JSON)
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null  # the GGUF in three parts, .carry/r1..r3
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
probe() {  # MODEL NAME [ARGS...]: the probe, its per-schedule lines
    model=$1 name=$2
    shift 2
    timeout ${PROBE_S:-110} python3 -m ddserve.bench.nonfinite_probe --model $model \
        --prompts ${PROMPTS:-8} --max-tokens ${TOKENS:-64} --name $name --out $OUT "$@" 2>&1 |
        quiet | grep -e "@B" -e Error | sed "s/^/$name /" | cut -c1-160
    echo "$name: ${SECONDS}s"
}
tuned() {  # MODEL NAME JSON [ARGS...]: the probe under bench.tuned
    model=$1 name=$2 json=$3
    shift 3
    timeout ${PROBE_S:-110} python3 -m ddserve.bench.tuned $json ddserve.bench.nonfinite_probe \
        --model $model --prompts ${PROMPTS:-8} --max-tokens ${TOKENS:-64} --name $name \
        --out $OUT "$@" 2>&1 | quiet | grep -e "@B" -e Error | sed "s/^/$name /" | cut -c1-160
    echo "$name: ${SECONDS}s"
}
variants() {  # MODEL PREFIX
    probe $1 $2-mended
    tuned $1 $2-inpool bench/lease/capture_in_pool.json
    probe $1 $2-mended-steps4 --steps 4
    if [ -n "${ALL:-}" ]; then
        tuned $1 $2-unsplit bench/lease/unsplit_all.json
        probe $1 $2-sdpa --attention sdpa
        probe $1 $2-torch --fused-layers off
        probe $1 $2-nographs --graphs off
    fi
}
case ${CALL:?} in
1)
    timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/engine/test_static_engine.py \
        -k "budgets_changing or split_k_counters" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    variants random-smollm2 rand
    ;;
2) ls -la /root/parts | tail -3 ;;
3) variants smollm2-135m real ;;
4)
    v=()
    [ -n "${VARIANT:-}" ] && v=(ddserve.bench.tuned $VARIANT)
    timeout ${LOAD_S:-400} python3 -m ${v[@]:-} ddserve.bench.engine_load --device cuda \
        --configs ${LOAD:-ar,ar@steps4,dflash-b15k4@steps4,dflash-b15k4@adaptive@steps4} \
        --concurrency ${LEVELS:-1,2,16,64} --requests 32 --waves ${WAVES:-4} --max-tokens 128 \
        --prompt-set heldout:16 --name load --out $OUT 2>&1 | quiet |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" | cut -c1-120
    echo "load: ${SECONDS}s"
    ;;
esac
echo "done at ${SECONDS}s"
