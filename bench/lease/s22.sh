# The next training run (issue 14), as run 8 taught (bench/NOTES.md, twenty-first session): a
# continuation on new data alone at the full learning rate did not improve the builtin
# drafter; run 7, which kept the earlier corpus in its mix, did. So: a fresh corpus, plus any
# corpus kept from earlier (run 8's is 4.9 MB: carry it as .carry/corpus8 = corpus-000.npz +
# heldout.npz when this checkout has it), a lower peak lr, and the drafter's own vocabulary
# (training writes it). Calls back to back (the machine stays warm ~30 s after a call):
#   0  carry .whl .carry/q1, then .carry/q2b  the GGUF's parts (NO_RAY=1 bench/device_pack.sh)
#   1  carry .carry/q3b       the corpus, TRAIN_SEED=4 -> /root/work and $OUT (~5.5 min)
#   2  carry .carry/corpus8   continue the builtin drafter on both corpora, LR=3e-4; eval
#      (or nothing)           prints the simulated tau per domain beside depth agreement
#   3  (nothing)              C=1 builtin vs new (greedy and T=1), fp32 greedy == AR, the
#                             runner at C=1/2: AR / b16k4 fixed / adaptive (the new one)
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
case ${CALL:?} in
0) ls -la /root/parts | tail -4 ;;
1) TRAIN_SEED=${TRAIN_SEED:-4} MINUTES=${MINUTES:-5.5} bash bench/lease/train_corpus.sh ;;
2)  from=""
    [ -f .carry/corpus8/corpus-000.npz ] && from=.carry/corpus8
    CORPUS_FROM=$from LR=${LR:-3e-4} TRAIN=${TRAIN:-6} bash bench/lease/train_drafter.sh ;;
3) bash bench/lease/compare_drafter.sh ;;
esac
echo "call $CALL done at ${SECONDS}s"
