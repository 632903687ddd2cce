# Twenty-ninth session: why adaptive speculation's rounds end requests with non-finite logits on
# a GPU (twenty-eighth session, H100, bf16: 18/32 requests at C=1, 32/32 at C=2; fixed b15/k4
# none), then the load levels again. One lease, calls back to back on one machine (it goes back
# 30 s after a call). `CALL=N bash bench/lease/s31.sh`:
#   1  carry .whl .carry/r1   random SmolLM2 weights (no GGUF yet): the GPU test of changing
#                   budgets (bf16, B 1 and 2), then bench.nonfinite_probe as served and with
#                   one suspect out at a time: split-K off, sdpa attention, torch's layers,
#                   no CUDA graphs (a variant that ends no request where the default ends
#                   some names the part to read)
#   2  carry .carry/r2        the GGUF's second part
#   3  carry .carry/r3        the same probe on the real weights (where call 1's random weights
#                   did not fail), default and the variants
#   4  (nothing)              load levels through the in-process runner (C 1/2/16/64, 128
#                   tokens, ignore_eos): AR 1 / 4 steps, b15/k4 fixed at 4 rounds a trip,
#                   adaptive at 4 (LOAD, VARIANT: a bench.tuned JSON with the mend if call 1
#                   or 3 found one)
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null  # the GGUF in three parts, .carry/r1..r3
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
probe() {  # MODEL NAME [ARGS...]: the probe, its per-schedule lines
    model=$1 name=$2
    shift 2
    timeout ${PROBE_S:-75} python3 -m ddserve.bench.nonfinite_probe --model $model \
        --prompts ${PROMPTS:-8} --max-tokens ${TOKENS:-64} --name $name --out $OUT "$@" 2>&1 |
        quiet | grep -e "@B" -e Error | sed "s/^/$name /" | cut -c1-160
    echo "$name: ${SECONDS}s"
}
tuned() {  # MODEL NAME JSON [ARGS...]: the probe under bench.tuned
    model=$1 name=$2 json=$3
    shift 3
    timeout ${PROBE_S:-75} python3 -m ddserve.bench.tuned $json ddserve.bench.nonfinite_probe \
        --model $model --prompts ${PROMPTS:-8} --max-tokens ${TOKENS:-64} --name $name \
        --out $OUT "$@" 2>&1 | quiet | grep -e "@B" -e Error | sed "s/^/$name /" | cut -c1-160
    echo "$name: ${SECONDS}s"
}
variants() {  # MODEL PREFIX
    probe $1 $2-default
    tuned $1 $2-unsplit bench/lease/unsplit_all.json
    probe $1 $2-sdpa --attention sdpa
    probe $1 $2-torch --fused-layers off
    probe $1 $2-nographs --graphs off
}
case ${CALL:?} in
1)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_static_engine.py \
        -k budgets_changing 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
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
