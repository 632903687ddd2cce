# Nineteenth session: training run 6 (issue 14), one lease, calls back to back (the machine
# stays warm ~30 s after a call). `CALL=N bash bench/lease/s19.sh`:
#   0  carry .whl .carry/q1, then .carry/q2   the GGUF's parts, nothing else
#   1  carry .carry/q3   the corpus through our engine, training prompts of another seed
#                        (TRAIN_SEED=1: run 5's corpus is gone; the held-out set is run 5's)
#                        -> /root/work and $OUT (bench/lease/train_corpus.sh)
#   2  (nothing)         continue the builtin drafter (run 5) on it, held-out agreement per
#                        domain -> $OUT (bench/lease/train_drafter.sh)
#   3  (nothing)         the new drafter against the builtin one, same call: C=1 tok/s and
#                        tau on the 16 held-out prompts (greedy, bf16), the in-process runner
#                        at C=1/2/16/64 (AR, b16k4 adaptive), fp32 greedy == AR with the new one;
#                        first the green-context probe (python -m ddserve.bench.green_probe)
mkdir -p /root/parts
cp .carry/q?/* /root/parts/ 2>/dev/null
case ${CALL:?} in
0) ls -la /root/parts | tail -3 ;;
1) TRAIN_SEED=${TRAIN_SEED:-1} bash bench/lease/train_corpus.sh ;;
2) bash bench/lease/train_drafter.sh ;;
3)  . bench/device_env.sh /root/parts
    D=/root/work/drafter
    # issue 18: whether a green context keeps a decode step fast beside a prompt chunk
    timeout 60 python3 -m ddserve.bench.green_probe --out $OUT/green_probe.json 2>&1 | tail -40
    cp service/engine/dflash_weights/smollm2-135m/draft_vocab.safetensors $D/ 2>/dev/null
    for d in builtin new; do
        dl=()
        [ $d = new ] && dl=(--dflash $D)
        timeout 120 python3 -m ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 --max-tokens 128 \
            --configs ar,dflash-b16k4,dflash-b8k2,dflash-b32k4 --sampled-configs "" "${dl[@]}" --no-server \
            --name c1-$d --out $OUT 2>&1 | grep -v Warning | tail -6
    done
    DFLASH=$D TAG=new LEVELS=1,2,16,64 CONFIGS=ar,dflash-b16k4@adaptive \
        timeout 170 bash bench/speculation.sh $OUT load
    DFLASH=$D TAG=new timeout 100 bash bench/speculation.sh $OUT lossless
    rm -f $OUT/*.png
    ;;
esac
echo "call $CALL done at ${SECONDS}s"
