# Ninth session, the third call of a lease whose calls 1-2 carried the GGUF's first parts
# (`.carry/q1` with `.whl`, then `.carry/q2`): this one carries `.carry/q3` and profiles a round
# of the static engine at 16 and 64 requests (`bench.round_profile`: AR, the DFlash engine at
# budget 0, fixed b7/k4 and b16/k4), where issue 14's C=64 loses to AR.
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
timeout ${LIMIT:-500} python3 -m ddserve.bench.round_profile --device cuda \
    --configs ${CONFIGS:-ar,dflash-b0,dflash-b7k4,dflash-b16k4} --batches ${BATCHES:-16,64} \
    --rounds ${ROUNDS:-50} --name ${NAME:-round_profile} --out $R 2>&1 | grep -v -e transformers -e Convert -e Loading
tar czf $OUT/res-profile.tgz -C /root res
