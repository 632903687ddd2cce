# Tenth session, call 3 (carries `.carry/q3` and `.carry/old`, an earlier commit's service/ made
# by `git archive REV service | tar -x -C .carry/old --exclude=service/engine/dflash_weights`):
# side by side in one call, the earlier code against this tree, each with today's bench/:
#   a ~7,200-token prompt's TTFT at C=1 through `ddserve engine` (paced defaults, AR)
#   bench.engine_load at C=2/64 (LOAD_C), AR and b16/k4 adaptive (WAVES=8, held-out prompts)
. bench/lease/old_env.sh  # the GGUF joined; /tmp/pp (this tree), /tmp/pp-old; R, quiet
for v in old new; do
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root DEVICE=cuda LENGTHS=${LENGTHS:-7200} LEVELS=1 REQ=${REQ:-32} \
        timeout ${TTFT_S:-130} bash bench/long_context.sh $R/lc-$v paced 2>&1 | quiet | tail -3
    tar czf $OUT/res3.tgz -C /root res
done
for v in old new; do
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root timeout ${LOAD_S:-130} python3 -m ddserve.bench.engine_load \
        --device cuda --configs ar,dflash-b16k4@adaptive --concurrency ${LOAD_C:-2,64} --requests 32 \
        --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-$v --out $R 2>&1 | quiet
    tar czf $OUT/res3.tgz -C /root res
done
