# For the next lease: its third call, after calls 1-2 carried `.carry/q1` (with `.whl`) and
# `.carry/q2` (this one carries `.carry/q3` and `.carry/old`: the service/ of 9af0a55, the commit
# before the one-buffer KV moves, `git archive 9af0a55 service | tar -x -C .carry/old ...`,
# see old_env.sh). What the tenth session left unmeasured, in the order of its value:
#   the API process's part of a long prompt's first token on this host (no GPU needed)
#   issue 14's levels with the adaptive policy's warmed-up gains (C=1..64)
#   the one-buffer KV moves: round_profile of the earlier code against this tree (a cold
#   start compiles the kernels first: give each run PROFILE_S, 150 s)
. bench/lease/old_env.sh  # the GGUF joined; /tmp/pp (this tree), /tmp/pp-old; R, quiet
nproc
timeout 120 python3 -m ddserve.bench.api_overhead --lengths 30,2900,7200 --requests 30 \
    --out $R 2>&1 | quiet | tail -3
tar czf $OUT/res-next.tgz -C /root res
timeout ${LOAD_S:-200} python3 -m ddserve.bench.engine_load --device cuda \
    --configs ar,dflash-b16k4,dflash-b16k4@adaptive --concurrency 1,2,4,16,64 --requests 32 \
    --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-levels --out $R 2>&1 | quiet
tar czf $OUT/res-next.tgz -C /root res
for v in old new; do
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root timeout ${PROFILE_S:-150} python3 -m ddserve.bench.round_profile \
        --device cuda --configs ar,dflash-b16k4 --batches 1,64 --turnover 0 --rounds 100 \
        --name rp-$v --out $R 2>&1 | quiet | grep -v '^      '
    tar czf $OUT/res-next.tgz -C /root res
done
