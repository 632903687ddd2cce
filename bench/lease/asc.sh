# Issue 13, `--api-server-count` (eighth session): the in-process runner, `ddserve engine` with
# one API process and with API_SERVERS (4) over one core, AR (budget 0), C=1/16/64, one call of
# a lease whose GGUF has arrived (after `spec_measure.sh load`, or calls 1-3 of `parts.sh`).
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
nproc
LEVELS=${LEVELS:-1,16,64} REQ=${REQ:-64} BUDGETS=0 PROMPTS=chat MAXB=64 timeout 540 \
    bash bench/serving_path.sh $R/asc inproc http http-asc 2>&1 | grep -v transformers | tail -14
python3 -m ddserve.bench.serving_path_report $R/asc 2>&1 | tail -12
rm -f $R/*/*.png; tar czf $OUT/res-asc.tgz -C /root res
