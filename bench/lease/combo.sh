# Eighth session, the third call of a lease whose calls 1-2 carried the GGUF's first parts
# (`.carry/q1` with `.whl`, then `.carry/q2`): this one carries `.carry/q3` and measures, in one
# call (a machine can be lost between calls):
#   issue 14: the in-process runner at C=1..64 with WAVES=8 levels: AR, the DFlash engine at
#             budget 0, b16k4, b16k4 adaptive (the start-up cost model's first GPU run)
#   issue 13: `ddserve engine` with one API process and with 4 (`--api-server-count`), AR,
#             C=1/16/64, chat prompts
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
TAG=run5 WAVES=8 CONFIGS=ar,dflash-b0,dflash-b16k4,dflash-b16k4@adaptive timeout 330 \
    bash bench/speculation.sh $R load 2>&1 | grep -v -e transformers -e '^  '
LEVELS=1,16,64 REQ=64 BUDGETS=0 PROMPTS=chat MAXB=64 API_SERVERS=4 timeout 230 \
    bash bench/serving_path.sh $R/asc http http-asc 2>&1 | grep -v transformers | tail -12
python3 -m ddserve.bench.serving_path_report $R/asc 2>&1 | grep -v Warn | tail -8
rm -f $R/*.png $R/*/*.png; tar czf $OUT/res-combo.tgz -C /root res
