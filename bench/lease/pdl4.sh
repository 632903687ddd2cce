# Eleventh session, a lone call (carries `.whl`): after pdl1-3, the defaults from pdl1's
# kernel sweep, short contexts' attention in key splits (tree forwards on an idle GPU),
# and the forward's inputs (RoPE's cos/sin, slots, write positions) and the residual read
# before/at the wait. Verify steps side by side (compiled layers; fused without PDL or
# prefetches; fused), GPU tests of the kernels, then the kernels one by one at 1 row.
mkdir -p /root/res
. bench/device_env.sh /root/parts
R=/root/res
timeout 150 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,4,16 \
    --widths 1,2,8,16 --attention triton --modes compile,fused-plain,fused \
    --name step4 --out $R 2>&1 | grep -E " gpu "
tar czf $OUT/res4.tgz -C /root res
timeout 130 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_layer_triton.py \
    tests/engine/test_attention.py > $R/gpu_tests4.txt 2>&1; tail -2 $R/gpu_tests4.txt
grep -E "^FAILED|^ERROR" $R/gpu_tests4.txt | head -5
tar czf $OUT/res4.tgz -C /root res
timeout 150 python3 -m ddserve.bench.layer_kernels --rows 1 --name lk4 --out $R 2>&1 | grep -E "best|per layer"
tar czf $OUT/res4.tgz -C /root res
