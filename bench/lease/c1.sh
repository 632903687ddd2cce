# Tenth session, third call of a lease whose calls 1-2 carried `.carry/q1` (with `.whl`) and
# `.carry/q2` (carries `.carry/q3` and `.carry/old`: the service/ of the commit before the
# one-buffer KV moves, `git archive HEAD~1 service | tar -x -C .carry/old
# --exclude=service/engine/dflash_weights`):
#   round_profile at 1 and 64 requests (b16/k4, lockstep), the
#   earlier code against this tree (the outputs' digests must be equal)
#   issue 14 at C=1/2: the adaptive policy's warmed-up gains against fixed b15/k4 (a 16-row
#   verify: the fused layers) and b16/k4 (17 rows: a 32-wide graph), this tree
. bench/lease/old_env.sh  # the GGUF joined; /tmp/pp (this tree), /tmp/pp-old; R, quiet
for v in old new; do
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root timeout ${PROFILE_S:-80} python3 -m ddserve.bench.round_profile \
        --device cuda --configs dflash-b16k4 --batches 1,64 --turnover 0 --rounds 100 \
        --name rp-$v --out $R 2>&1 | quiet | grep -v '^      '
    tar czf $OUT/res-c1.tgz -C /root res
done
[ "${LOAD_S:-130}" = 0 ] || timeout ${LOAD_S:-130} python3 -m ddserve.bench.engine_load --device cuda \
    --configs ar,dflash-b15k4,dflash-b16k4,dflash-b16k4@adaptive --concurrency 1,2 --requests 32 \
    --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-c1 --out $R 2>&1 | quiet
tar czf $OUT/res-c1.tgz -C /root res
