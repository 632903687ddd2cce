# Eleventh session, call 2 (carries `.carry/q2`), right after pdl1.sh: the kernels one by one
# at 32 rows (a b16/k4 tree's verify), then verify steps with both calls' best parameters
# and the row limit their whole-layer timings won, at 256 and 4,096 committed keys (the
# long class splits the keys: the merge kernel joins the chain).
mkdir -p /root/parts && cp .carry/q2/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
timeout 230 python3 -m ddserve.bench.layer_kernels --rows 32 --name lk32 --out $R 2>&1 | grep -E "best|per layer"
tar czf $OUT/res2.tgz -C /root res
timeout 300 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,2,4 \
    --widths 1,8,16 --context 256,4096 --attention triton --modes compile,fused-plain,fused-nopdl,fused \
    --fused-tune $R/lk1.json,$R/lk32.json --name step2 --out $R 2>&1 | grep -E " gpu "
tar czf $OUT/res2.tgz -C /root res
