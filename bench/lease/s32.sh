# Twenty-ninth session, second lease: DDTree against AR at 4 steps a trip with 16 waves a level
# (the first lease's 4 waves leave a tail: requests of varying length end at different times),
# and rounds a trip per level; then adaptive with the first token of a few newcomers waiting
# for the trip (rounds.FIRST_TOKEN_SHARE 0.5 then, a bench.tuned
# switch; since: engine_load --first-token-share 0.5). `CALL=N bash
# bench/lease/s32.sh`, calls back to back (the machine goes back 30 s after a call):
#   1  carry .carry/r1 .whl   2  carry .carry/r2   (the GGUF's parts; the wheels: pydantic..)
#   3  carry .carry/r3   the load levels
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
load() {  # NAME CONFIGS [ENGINE_LOAD ARGS...]
    name=$1 configs=$2
    shift 2
    timeout ${LOAD_S:-250} python3 -m ddserve.bench.engine_load --device cuda "$@" \
        --configs $configs --concurrency ${LEVELS:-1,2,16,64} --requests 32 --waves ${WAVES:-16} \
        --max-tokens 128 --prompt-set heldout:16 --name $name --out $OUT 2>&1 | quiet |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" | cut -c1-140
    echo "$name: ${SECONDS}s"
}
case ${CALL:?} in
1 | 2) ls -la /root/parts | tail -2 ;;
3)
    load load16 ar@steps4,dflash-b15k4@steps4,dflash-b15k4@adaptive@steps4
    load load16-ftshare dflash-b15k4@adaptive@steps4 --first-token-share 0.5
    ;;
esac
echo "done at ${SECONDS}s"
