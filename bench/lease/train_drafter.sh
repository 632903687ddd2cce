# Training run 5 (issue 14), call 4, right after train_corpus.sh on the same machine: continue
# the builtin drafter on the corpus in /root/work for TRAIN minutes, then the held-out
# agreement per domain -> $OUT (the weights gzipped: a return file holds at most 16 MiB).
# CORPUS_FROM=.carry/corpus5 (carried: run 5's corpus-000.npz + heldout.npz) trains on both.
. bench/device_env.sh /root/parts
W=/root/work
timeout 585 python3 -m ddserve.training.dflash --model smollm2-135m --device cuda --work $W \
    --stages train,eval --init service/engine/dflash_weights/smollm2-135m \
    --train-minutes ${TRAIN:-7.9} --lr ${LR:-1e-3} --warmup 50 ${CORPUS_FROM:+--corpus-from $CORPUS_FROM} 2>&1 \
    | grep -v -e transformers -e clean_up >$W/train.log
grep -v '"step"' $W/train.log | cut -c1-600 | tail -6
grep '"step"' $W/train.log | tail -2 | cut -c1-300
cp $W/train.log $W/eval.json $W/drafter/config.json $OUT/
gzip -c $W/drafter/model.safetensors >$OUT/model.safetensors.gz
[ -f $W/drafter/draft_vocab.safetensors ] && cp $W/drafter/draft_vocab.safetensors $OUT/
ls -la $OUT
