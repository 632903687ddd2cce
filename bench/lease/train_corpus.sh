# Training run 5 (issue 14), call 3 of a three-call lease (calls 1-2: `bash bench/lease/parts.sh`
# carrying .whl + .carry/q1, then .carry/q2; this one carries .carry/q3 (the GGUF part2), or .carry/q3b): the
# drafter's corpus through our engine at scale -> /root/work (kept for the next call, which
# must follow at once) and back in $OUT (parts of at most 15 MiB; the return takes 8 files).
# A later run: TRAIN_SEED=1 (other training prompts, the same held-out set as run 5's).
mkdir -p /root/parts /root/work && cp .carry/q3*/SmolLM2* /root/parts/ && . bench/device_env.sh /root/parts
W=/root/work
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 575 python3 -m ddserve.training.dflash --model smollm2-135m --device cuda --work $W \
    --stages corpus --corpus-minutes ${MINUTES:-7.6} --engine-batch ${BATCH:-256} \
    --continuations ${CONT:-12000} --gen-tokens 256 --temperatures 0,1 \
    ${TRAIN_SEED:+--train-seed $TRAIN_SEED} 2>&1 \
    | grep -v -e transformers -e clean_up >$W/corpus.log
grep -v '"seconds": [0-9.]*, "requests"' $W/corpus.log | cut -c1-400 | tail -12
grep '"phase": "answers", "seconds"' $W/corpus.log | tail -2 | cut -c1-200
ls -la $W
n=0
for f in $W/heldout.npz $W/corpus.log $W/corpus-*.npz; do
    [ $n -lt 8 ] && cp "$f" $OUT/ && n=$((n + 1))
done
