# Ninth session, the third call of a lease whose calls 1-2 carried the GGUF's first parts
# (`.carry/q1` with `.whl`, then `.carry/q2`): the engine's host work per round, the code of
# an earlier commit (its service/ in `.carry/old/service`, made by
# `git archive REV service | tar -x -C .carry/old --exclude=service/engine/dflash_weights`)
# against this tree's, side by side in one call, each run with today's bench/:
#   bench.round_profile at 64 requests, one joining each round (AR, b7/k4)
#   bench.engine_load at C=16/64 (AR, b16/k4 adaptive; WAVES=8, held-out prompts)
# Carries `.carry/q3`, `.carry/old` (and `.whl`).
. bench/lease/old_env.sh  # the GGUF joined; /tmp/pp (this tree), /tmp/pp-old; R, quiet
for v in ${PROFILE_VERSIONS-old new}; do  # PROFILE_VERSIONS= : engine_load alone
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root timeout ${PROFILE_S:-100} python3 -m ddserve.bench.round_profile \
        --device cuda --configs ar,dflash-b7k4 --batches 64 --turnover 1 --rounds 50 \
        --name rp-$v --out $R 2>&1 | quiet | grep -v '^      '
    tar czf $OUT/res-ab.tgz -C /root res  # what is there so far, if the lease ends early
done
for v in old new; do
    pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
    PYTHONPATH=$pp:/tmp/site:$root timeout ${LOAD_S:-170} python3 -m ddserve.bench.engine_load \
        --device cuda --configs ar,dflash-b16k4@adaptive --concurrency 16,64 --requests 32 \
        --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-$v --out $R 2>&1 | quiet
    tar czf $OUT/res-ab.tgz -C /root res
done
