# Eleventh session, call 1 (carries `.whl` and `.carry/q1`; calls 2-3 bring `.carry/q2`, `.carry/q3`):
# issue 17, the fused layers with programmatic dependent launch (PDL) and preloaded weight
# slices. GPU tests of the kernels (the PDL chain against serial launches, bit for bit), the
# kernels one by one at 1 row (bm 16), then one verify step: compiled layers, fused without
# PDL, fused with PDL, side by side (random SmolLM2-shaped weights: no GGUF needed).
mkdir -p /root/parts /root/res && cp .carry/q1/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
    tests/engine/test_attention.py > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
grep -E "^FAILED|^ERROR" $R/gpu_tests.txt | head -5
timeout 220 python3 -m ddserve.bench.layer_kernels --rows 1 --name lk1 --out $R 2>&1 | grep -E "best|per layer"
tar czf $OUT/res1.tgz -C /root res
timeout 200 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,16 \
    --widths 1,2,8,16 --attention triton --modes compile,fused-plain,fused-nopdl,fused --fused-tune $R/lk1.json \
    --name step1 --out $R 2>&1 | grep -E " gpu "
tar czf $OUT/res1.tgz -C /root res
