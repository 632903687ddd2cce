# Twentieth session: training run 7 (issue 14), one lease, calls back to back (the machine
# stays warm ~30 s after a call). `CALL=N bash bench/lease/s20.sh`:
#   0  carry .whl .carry/q1, then .carry/q2b  the GGUF's parts, nothing else (.carry/q2 with
#                             the tree passes 64 MiB: its last 10 MB went to .carry/q3b)
#   1  carry .carry/q3b       the corpus through our engine, training prompts of a third seed
#                             (TRAIN_SEED=2; the held-out set is run 5's and run 6's)
#                             -> /root/work and $OUT (bench/lease/train_corpus.sh)
#   2  carry .carry/corpus6   continue the builtin drafter (run 6) on this corpus and run 6's
#                             (run 6's corpus-000.npz, --corpus-from), held-out agreement per
#                             domain -> $OUT (bench/lease/train_drafter.sh)
#   3  (nothing)              the new drafter against the builtin one, same call: C=1 tok/s and
#                             tau on the 16 held-out prompts (greedy, bf16), T=1 AR / b16k4 with
#                             the new one, the in-process runner at C=1/2/16/64 (AR, b16k4
#                             fixed and adaptive) with the new one
#   4  (nothing)              fp32 greedy == AR with the new drafter (b16k4, b8k2)
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
case ${CALL:?} in
0) ls -la /root/parts | tail -3 ;;
1) TRAIN_SEED=${TRAIN_SEED:-2} MINUTES=${MINUTES:-5.5} bash bench/lease/train_corpus.sh ;;
2) CORPUS_FROM=.carry/corpus6 TRAIN=${TRAIN:-6.5} bash bench/lease/train_drafter.sh ;;
3) BUILTIN_VOCAB=1 LOSSLESS=0 LEVELS=1,2,16,64 LOAD_TIMEOUT=250 bash bench/lease/compare_drafter.sh ;;
4)  . bench/device_env.sh /root/parts
    D=/root/work/drafter
    DFLASH=$D TAG=new LOSSLESS_CONFIGS=ar,dflash-b16k4,dflash-b8k2 timeout 500 bash bench/speculation.sh $OUT lossless
    ;;
esac
echo "call $CALL done at ${SECONDS}s"
