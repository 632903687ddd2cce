# Eleventh session, a last short call (carries `.whl`): the short-context key splits limited
# to decode-shaped programs (<= 16 folded query rows), checked where pdl4.sh saw them hurt
# (16 x 16 rows, compiled layers) and help (1 row), compiled layers and fused, side by side.
mkdir -p /root/res
. bench/device_env.sh /root/parts
R=/root/res
timeout 140 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,16 \
    --widths 1,16 --attention triton --modes compile,fused --name step5 --out $R 2>&1 | grep -E " gpu "
tar czf $OUT/res5.tgz -C /root res
