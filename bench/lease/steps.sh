# The third call of a three-call lease (1: .whl + .carry/p1 with `bash bench/lease/call2.sh`-like
# copying, 2: .carry/p2, 3: this, carrying .carry/p3's GGUF part): the tokenizer on this host,
# then a 7,200-token prompt's TTFT at C=1 and its admission to 15 running streams, paced at
# --chunked-prefill-steps 1.5 and 2, side by side (two engines).
mkdir -p /root/parts /root/res && cp .carry/p3/SmolLM2* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
python3 - <<'PY' 2>&1 | grep -v Warn | tee $R/tokenizer_probe.txt
import time, tokenizers, transformers
from ddserve.api import pieces
from ddserve.bench.prompts import synthetic_set
from ddserve.engine.weights import load_tokenizer
tok = load_tokenizer("smollm2-135m")
p = synthetic_set(7200, 1, "smollm2-135m")[0][0]
print("tokenizers", tokenizers.__version__, "transformers", transformers.__version__, "ready", pieces.ready(tok), "threads", pieces.cpu_threads())
def med(fn):
    ts = []
    for _ in range(9):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return round(sorted(ts)[4] * 1e3, 2)
print("pieces ms", med(lambda: pieces.encode_pieces(tok, p)), "whole ms", med(lambda: tok.encode(p, add_special_tokens=False)))
PY
for st in 1.5 2; do
    STEPS=$st DEVICE=cuda LENGTHS=7200 LEVELS=1 REQ=16 timeout 260 bash bench/long_context.sh $R/steps$st paced 2>&1 | grep -v transformers | tail -8
done
grep -h "tokenised" $R/steps*/paced-engine.log | head -2
rm -f $R/*/*.png; tar czf $OUT/res.tgz -C /root res
