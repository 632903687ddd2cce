# Ninth session, the third call of a lease whose calls 1-2 carried the GGUF's first parts
# (`.carry/q1` with `.whl`, then `.carry/q2`): this one carries `.carry/q3` and profiles a round
# of the static engine (`bench.round_profile`: AR, the DFlash engine at budget 0, fixed b7/k4),
# where issue 14's C=64 loses to AR: the same requests throughout at 16 and 64, then at 64
# with one leaving and one joining every round (as served at C=64).
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
for pass in "0 16,64 300" "1 64 220"; do  # turnover, batches, limit (s)
    set -- $pass
    timeout $3 python3 -m ddserve.bench.round_profile --device cuda \
        --configs ${CONFIGS:-ar,dflash-b0,dflash-b7k4} --batches $2 --turnover $1 \
        --rounds ${ROUNDS:-50} --name round_profile_t$1 --out $R 2>&1 |
        grep -v -e transformers -e Convert -e Loading
done
tar czf $OUT/res-profile.tgz -C /root res
