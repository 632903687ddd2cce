# Twenty-ninth session, second lease: DDTree against AR at 4 steps a trip with 16 waves a level
# (the first lease's 4 waves leave a tail: requests of varying length end at different times),
# and rounds a trip per level; then adaptive with the first token of a few newcomers waiting
# for the trip (rounds.FIRST_TOKEN_SHARE 0.5, first_token_half.json). `CALL=N bash
# bench/lease/s32.sh`, calls back to back (the machine goes back 30 s after a call):
#   1  carry .carry/r1   2  carry .carry/r2   (the GGUF's parts)
#   3  carry .carry/r3   the load levels
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
load() {  # NAME CONFIGS [tuned JSON]
    v=()
    [ -n "${3:-}" ] && v=(ddserve.bench.tuned $3)
    timeout ${LOAD_S:-250} python3 -m ${v[@]:-} ddserve.bench.engine_load --device cuda \
        --configs $2 --concurrency ${LEVELS:-1,2,16,64} --requests 32 --waves ${WAVES:-16} \
        --max-tokens 128 --prompt-set heldout:16 --name $1 --out $OUT 2>&1 | quiet |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" | cut -c1-140
    echo "$1: ${SECONDS}s"
}
case ${CALL:?} in
1 | 2) ls -la /root/parts | tail -2 ;;
3)
    load load16 ar@steps4,dflash-b15k4@steps4,dflash-b15k4@adaptive@steps4
    load load16-ftshare dflash-b15k4@adaptive@steps4 bench/lease/first_token_half.json
    ;;
esac
echo "done at ${SECONDS}s"
