# Eleventh session, call 3 (carries `.carry/q3`: the GGUF joined), right after pdl2.sh: the
# engine on SmolLM2's real weights with calls 1-2's tuning (bench.tuned): C=1 decode, fused
# against torch's layers, AR and DFlash b16/k4 (bf16); greedy in fp32 through the fused
# kernels against torch's layers; then issue 14's load levels on the tuned kernels.
mkdir -p /root/parts && cp .carry/q3/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
T="$R/lk1.json,$R/lk32.json"
ls $R
timeout 220 python3 -m ddserve.bench.tuned $T ddserve.bench.engine_cpu --device cuda \
    --prompt-set heldout:16 --max-tokens 128 --configs ar,ar@nofused,dflash-b16k4,dflash-b16k4@nofused \
    --sampled-configs "" --no-server --name fused_bf16 --out $R 2>&1 | grep -v Warn | tail -8
tar czf $OUT/res3.tgz -C /root res
timeout 130 python3 -m ddserve.bench.tuned $T ddserve.bench.engine_cpu --device cuda --dtype float32 \
    --prompt-set heldout:8 --max-tokens 96 --configs ar,ar@fused,dflash-b16k4@fused \
    --sampled-configs "" --no-server --name fused_fp32 --out $R 2>&1 | grep -v Warn | tail -6
tar czf $OUT/res3.tgz -C /root res
timeout 200 python3 -m ddserve.bench.tuned $T ddserve.bench.engine_load --device cuda \
    --configs ar,dflash-b16k4,dflash-b16k4@adaptive --concurrency 1,2,16,64 --requests 32 \
    --waves 8 --max-tokens 128 --prompt-set heldout:16 --name load-levels --out $R 2>&1 \
    | grep -v Warn | tail -16
tar czf $OUT/res3.tgz -C /root res
