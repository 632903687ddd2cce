# Tenth session, call 1 (carries `.whl` and `.carry/q1`; calls 2-3 bring `.carry/q2`, `.carry/q3`):
# the fresh prompt chunks by variable-length flash attention and the finer fresh widths. GPU
# tests of the attention and the static engine, then one prefill on an idle engine by path,
# side by side (`static_step --prefill`: served = varlen + the new widths; padded; coarse = the
# widths before; no-fresh; no-graph), random SmolLM2-shaped weights (the GGUF is not there yet).
mkdir -p /root/parts /root/res && cp .carry/q1/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
python3 -c "import torch, inspect; from torch.nn.attention.varlen import varlen_attn; print(torch.__version__, inspect.signature(varlen_attn))" 2>&1 | tail -1 | tee $R/varlen_sig.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py \
    tests/engine/test_static_engine.py -k "fresh or graphs or prompt_chunks or idle or warm_up" \
    > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
timeout 240 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1 --widths 2 \
    --context 30 --attention triton --modes compile --prefill 1000,2900,7200 \
    --name static_step_fresh --out $R 2>&1 | grep -v Warn | grep prefill
tar czf $OUT/res1.tgz -C /root res
