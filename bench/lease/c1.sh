# Tenth session, third call of a lease whose calls 1-2 carried `.carry/q1` (with `.whl`) and
# `.carry/q2` (carries `.carry/q3`): issue 14 at C=1/2 — the adaptive policy's warmed-up gains
# against fixed b15/k4 (a 16-row verify: the fused layers) and b16/k4 (17 rows: a 32-wide
# graph), then where a C=1 round's time goes (`round_profile --batches 1`, cProfile).
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
quiet() { grep -v -e transformers -e Convert -e Loading -e '^  '; }
timeout ${LOAD_S:-200} python3 -m ddserve.bench.engine_load --device cuda \
    --configs ar,dflash-b15k4,dflash-b16k4,dflash-b16k4@adaptive --concurrency 1,2 --requests 32 \
    --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-c1 --out $R 2>&1 | quiet
tar czf $OUT/res-c1.tgz -C /root res
timeout ${PROFILE_S:-120} python3 -m ddserve.bench.round_profile --device cuda \
    --configs ar,dflash-b15k4,dflash-b16k4 --batches 1 --rounds 200 --name rp-c1 --out $R 2>&1 | quiet
tar czf $OUT/res-c1.tgz -C /root res
