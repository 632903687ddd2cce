# The third call of a three-call lease (calls 1-2: `bash bench/lease/parts.sh` carrying .whl +
# .carry/p1, then .carry/p2; this one carries .carry/p3's GGUF part): the tokenizer on this
# host, then a 7,200-token prompt's TTFT at C=1 and its admission to 15 running streams,
# paced at --chunked-prefill-steps 1.5 and 2, side by side (two engines).
mkdir -p /root/parts /root/res && cp .carry/p3/SmolLM2* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
python3 -m ddserve.bench.tokenizer_probe 2>&1 | grep -E "^(tokenizers|pieces)" | tee $R/tokenizer_probe.txt
for st in 1.5 2; do
    STEPS=$st DEVICE=cuda LENGTHS=7200 LEVELS=1 REQ=16 timeout 260 bash bench/long_context.sh $R/steps$st paced 2>&1 | grep -v transformers | tail -8
done
grep -h "tokenised" $R/steps*/paced-engine.log | head -2
rm -f $R/*/*.png; tar czf $OUT/res.tgz -C /root res
