# For the thirtieth session: whether prompts joining beside a trip of 4 rounds (rounds.
# JOIN_BESIDE_TRIP, an experiment: joins counted under --first-token-share instead of one
# round each) lifts rounds a trip and throughput at C=16/64 (twenty-ninth session: adaptive
# with first-token share 0.5 ran 1.6 rounds a trip of 4 at C=64, 1.02x AR at 4 steps), what
# it costs the first token, and the GPU tests. `CALL=N bash bench/lease/s33.sh`, back to back:
#   1  carry .carry/r1 .whl   the GPU tests (-k cuda, tests/engine) while the parts come
#   2  carry .carry/r2
#   3  carry .carry/r3        load levels, 16 waves: AR at 4 steps, adaptive b15/k4 at 4 steps
#                             with first-token share 0.5, then the same with join_beside.json
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
load() {  # NAME CONFIGS JSON|- [ENGINE_LOAD ARGS...] (JSON: a bench.tuned file)
    name=$1 configs=$2 v=()
    [ "$3" != - ] && v=(ddserve.bench.tuned $3)
    shift 3
    timeout ${LOAD_S:-250} python3 -m ${v[@]:-} ddserve.bench.engine_load --device cuda "$@" \
        --configs $configs --concurrency ${LEVELS:-1,2,16,64} --requests 32 --waves ${WAVES:-16} \
        --max-tokens 128 --prompt-set heldout:16 --name $name --out $OUT 2>&1 | quiet |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" -e Error | cut -c1-140
    echo "$name: ${SECONDS}s"
}
case ${CALL:?} in
1)
    timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider tests/engine -k cuda 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
2) ls -la /root/parts | tail -2 ;;
3)
    load load16 ar@steps4,dflash-b15k4@adaptive@steps4 - --first-token-share 0.5
    load load16-beside dflash-b15k4@adaptive@steps4 bench/lease/join_beside.json \
        --first-token-share 0.5
    ;;
esac
echo "done at ${SECONDS}s"
