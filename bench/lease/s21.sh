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
3) BUILTIN_VOCAB=1 bash bench/lease/compare_drafter.sh ;;
esac
echo "call $CALL done at ${SECONDS}s"
