# Tenth session, call 1 (carries `.whl` and `.carry/q1`; calls 2-3 bring `.carry/q2`, `.carry/q3`):
# a prompt's first chunk in the finer fresh widths (every 512 tokens above 4,096) and its last
# layer's keys and values alone. GPU tests of the attention and the static engine, then one
# prefill on an idle engine by path, side by side (`static_step --prefill`: served; coarse = the
# fresh widths before; no-fresh; no-graph), random SmolLM2-shaped weights (no GGUF needed).
mkdir -p /root/parts /root/res && cp .carry/q1/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py \
    tests/engine/test_static_engine.py -k "cuda or graphs or prompt_chunks or idle or warm_up or last_layer" \
    > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
timeout 240 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1 --widths 2 \
    --context 30 --attention triton --modes compile --prefill 1000,2900,7200 \
    --name static_step_fresh --out $R 2>&1 | grep -v Warn | grep prefill
tar czf $OUT/res1.tgz -C /root res
