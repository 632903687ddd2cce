# A trained drafter against the builtin one, in one call on the lent GPU (the training leases'
# last call: s20.sh, s21.sh, s22.sh), after the GGUF's parts are in /root/parts:
#   C=1 greedy tok/s and tau, builtin then new (16 held-out prompts, 128 tokens, bf16), T=1
#   AR / b16k4 with the new one; fp32 greedy == AR with the new one (LOSSLESS=1); the
#   in-process runner at LEVELS (AR, b16k4 fixed and adaptive) with the new one.
# env: D (the new drafter, /root/work/drafter), LEVELS (1,2), LOSSLESS (1), LOAD_TIMEOUT (200),
#      BUILTIN_VOCAB=1 (give the new drafter the builtin one's draft vocabulary: drafters
#      trained before training wrote their own)
. bench/device_env.sh /root/parts
D=${D:-/root/work/drafter}
[ "${BUILTIN_VOCAB:-0}" = 1 ] && cp service/engine/dflash_weights/smollm2-135m/draft_vocab.safetensors $D/
for d in builtin new; do
    dl=() sc=""
    [ $d = new ] && dl=(--dflash $D) sc=ar,dflash-b16k4
    timeout 150 python3 -m ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 --max-tokens 128 \
        --configs ar,dflash-b16k4,dflash-b8k2,dflash-b32k4 --sampled-configs "$sc" "${dl[@]}" --no-server \
        --name c1-$d --out $OUT 2>&1 | grep -v Warning | tail -8
    echo "c1-$d: ${SECONDS}s"
done
if [ "${LOSSLESS:-1}" = 1 ]; then
    DFLASH=$D TAG=new LOSSLESS_CONFIGS=ar,dflash-b16k4,dflash-b8k2 timeout 150 bash bench/speculation.sh $OUT lossless
fi
DFLASH=$D TAG=new LEVELS=${LEVELS:-1,2} CONFIGS=ar,dflash-b16k4,dflash-b16k4@adaptive \
    timeout ${LOAD_TIMEOUT:-200} bash bench/speculation.sh $OUT load
rm -f $OUT/*.png
