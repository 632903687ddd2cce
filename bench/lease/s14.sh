# Fourteenth session: one H200 lease of three calls back to back (the machine stays warm 30 s
# after a call; each call carries at most 64 MiB with the tree). `CALL=N bash bench/lease/s14.sh`:
#   1  carry .whl .carry/q1   the GGUF's first part to /root/parts, nothing else
#   2  carry .carry/q2        its second part
#   3  carry .carry/q3        issue 18 with the pacer's fixed + per-token model: C=16 at ~30 and
#                             ~2,900 tokens, paced (with the admission run: 15 streams while a
#                             ~7,200-token prompt arrives) then capped, the scheduler log line;
#                             issue 14's C=1/2 (AR, adaptive b16/k4) with the overlap on again
mkdir -p /root/parts $OUT/res
cp .carry/q?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=$OUT/res  # straight under $OUT: a call cut short by the budget still brings back what it wrote
quiet() { grep -v -E 'Warn|transformers|^ *$'; }
case ${CALL:?} in
1 | 2) ls -la /root/parts ;;
3)
    SECONDS=0
    LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 230 bash bench/long_context.sh $R/lc16 paced \
        2>&1 | quiet | tail -8
    ADMIT=0 LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 130 bash bench/long_context.sh $R/lc16 capped \
        2>&1 | quiet | tail -6
    grep -h "Decode batch" $R/lc16/paced-engine.log | tail -12 | cut -c 1-300
    echo "issue 18 done at ${SECONDS}s"
    timeout 170 python3 -m ddserve.bench.engine_load --device cuda \
        --configs ar,dflash-b16k4@adaptive --concurrency 1,2 \
        --requests 32 --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-c12 \
        --out $R 2>&1 | quiet | tail -6
    echo "all done at ${SECONDS}s"
    rm -f $R/*.png $R/*/*.png
    ;;
esac
