# Training run 5 (issue 14), call 5, right after train_drafter.sh: the new drafter (in
# /root/work/drafter) against the builtin one, same lease: C=1 tok/s and tau on the 16
# held-out prompts (ddserve.bench.engine_cpu, greedy, bf16), then the in-process runner at
# C=1..64 and T=1, and fp32 greedy == AR with the new drafter.
. bench/device_env.sh /root/parts
R=/root/res5 D=/root/work/drafter
mkdir -p $R
for d in builtin new; do
    dl=()
    [ $d = new ] && dl=(--dflash $D)
    timeout 150 python3 -m ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 --max-tokens 128 \
        --configs ar,dflash-b16k4,dflash-b8k2,dflash-b32k4 --sampled-configs "" "${dl[@]}" --no-server \
        --name c1-$d --out $R 2>&1 | grep -v Warning | tail -6
done
DFLASH=$D TAG=new LEVELS=${LEVELS:-1,2,4,16,64} CONFIGS=ar,dflash-b16k4,dflash-b16k4@adaptive \
    timeout ${LOADT:-200} bash bench/speculation.sh $R load sampled
DFLASH=$D TAG=new timeout 100 bash bench/speculation.sh $R lossless
rm -f $R/*.png; tar czf $OUT/res5.tgz -C /root res5
