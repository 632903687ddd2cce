# The third call of a three-call lease (calls 1-2: `bash bench/lease/parts.sh` carrying .whl +
# .carry/p1, then .carry/p2; this one carries .carry/p3's GGUF part): the tokenizer on this
# host (long prompts in pieces?), then long prompts through `ddserve engine` with the defaults
# (paced part: --chunked-prefill-steps 1.5) at ~30 / ~2,900 / ~7,200 tokens, C=1 and 16, and a
# 7,200-token prompt's admission to 15 running streams.
mkdir -p /root/parts /root/res && cp .carry/p3/SmolLM2* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
python3 -m ddserve.bench.tokenizer_probe 2>&1 | grep -E "^(tokenizers|pieces)" | tee $R/tokenizer_probe.txt
DEVICE=cuda LENGTHS=30,2900,7200 REQ=32 timeout 230 bash bench/long_context.sh $R/lc paced 2>&1 | grep -v transformers | tail -12
grep -h "tokenised" $R/lc/paced-engine.log | head -1
rm -f $R/*/*.png; tar czf $OUT/res.tgz -C /root res
