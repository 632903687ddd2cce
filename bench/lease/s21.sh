# Twenty-first session: training run 8 (issue 14), one lease, calls back to back (the machine
# stays warm ~30 s after a call). The checkout of this session came without run 7's weights or
# run 6's corpus (both lived outside git), so run 8 continues the builtin drafter (run 6) on
# a fresh corpus of a fourth training seed. `CALL=N bash bench/lease/s21.sh`:
#   0  carry .whl .carry/q1, then .carry/q2b  the GGUF's parts (NO_RAY=1 bench/device_pack.sh)
#   1  carry .carry/q3b       the corpus through our engine, TRAIN_SEED=3 (held-out: seed 0, as
#                             runs 5-7) -> /root/work and $OUT (bench/lease/train_corpus.sh)
#   2  (nothing)              continue the builtin drafter on it, held-out agreement per domain
#                             -> $OUT, weights gzipped (bench/lease/train_drafter.sh)
#   3  (nothing)              same call: C=1 greedy tok/s and tau, builtin vs new (16 held-out
#                             prompts, bf16), T=1 AR / b16k4 with the new one; fp32 greedy == AR
#                             with the new one (b16k4, b8k2); the in-process runner at C=1/2,
#                             AR / b16k4 fixed / b16k4 adaptive, the new drafter
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
case ${CALL:?} in
0) ls -la /root/parts | tail -4 ;;
1) TRAIN_SEED=${TRAIN_SEED:-3} MINUTES=${MINUTES:-6} bash bench/lease/train_corpus.sh ;;
2) TRAIN=${TRAIN:-7} bash bench/lease/train_drafter.sh ;;
3)  . bench/device_env.sh /root/parts
    D=/root/work/drafter
    cp service/engine/dflash_weights/smollm2-135m/draft_vocab.safetensors $D/ 2>/dev/null
    for d in builtin new; do
        dl=() sc=""
        [ $d = new ] && dl=(--dflash $D) sc=ar,dflash-b16k4
        timeout 150 python3 -m ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 --max-tokens 128 \
            --configs ar,dflash-b16k4,dflash-b8k2,dflash-b32k4 --sampled-configs "$sc" "${dl[@]}" --no-server \
            --name c1-$d --out $OUT 2>&1 | grep -v Warning | tail -8
        echo "c1-$d: ${SECONDS}s"
    done
    DFLASH=$D TAG=new LOSSLESS_CONFIGS=ar,dflash-b16k4,dflash-b8k2 timeout 150 bash bench/speculation.sh $OUT lossless
    DFLASH=$D TAG=new LEVELS=1,2 CONFIGS=ar,dflash-b16k4,dflash-b16k4@adaptive \
        timeout 200 bash bench/speculation.sh $OUT load
    rm -f $OUT/*.png
    ;;
esac
echo "call $CALL done at ${SECONDS}s"
