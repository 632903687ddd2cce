# Fifteenth session: one H200 lease of four calls back to back (the machine stays warm 30 s
# after a call; each call carries at most 64 MiB with the tree). `CALL=N bash bench/lease/s15.sh`:
#   1  carry .whl .carry/q1   the GGUF's first part to /root/parts; the GPU tests of the
#                             overlapped prefill (its own stream and graph lane) and of the
#                             static engine's graphs
#   2  carry .carry/q2        its second part
#   3  carry .carry/q3        issue 18: C=16 at ~30 and ~2,900 tokens with the new pacer,
#                             paced with the chunk beside the decode step (the default) and
#                             before it (--overlap-prefill off), each with the admission run
#   4  (nothing)              the same, capped (2,048 tokens a round), both ways; then paced at
#                             ~1,000 and ~7,200 tokens, C=1/16
# Results straight under $OUT (at most three folders deep: deeper ones do not come back).
mkdir -p /root/parts
cp .carry/q?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=$OUT
quiet() { grep -v -E 'Warn|transformers|^ *$'; }
rounds() { grep -h "Decode batch" "$1" | tail -${2:-6} | cut -c 1-260; }
SECONDS=0
case ${CALL:?} in
1)
    ls -la /root/parts
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_static_engine.py \
        -k "cuda" 2>&1 | tail -8
    echo "tests done at ${SECONDS}s"
    ;;
2) ls -la /root/parts ;;
3)
    for part in paced paced-serial; do
        LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 260 bash bench/long_context.sh $R/lc16 $part \
            2>&1 | quiet | tail -8
        rounds $R/lc16/$part-engine.log
        echo "$part done at ${SECONDS}s"
    done
    ;;
4)
    for part in capped capped-serial; do
        ADMIT=0 LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 150 bash bench/long_context.sh $R/lc16 \
            $part 2>&1 | quiet | tail -6
        rounds $R/lc16/$part-engine.log 4
        echo "$part done at ${SECONDS}s"
    done
    ADMIT=0 LENGTHS=1000,7200 LEVELS=1,16 REQ=32 timeout 200 bash bench/long_context.sh $R/lcw \
        paced 2>&1 | quiet | tail -8
    echo "all done at ${SECONDS}s"
    ;;
esac
rm -f $R/*/*.png $R/*/*/*.png
