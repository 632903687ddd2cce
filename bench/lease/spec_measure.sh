# Issue 14's table again, with the builtin drafter (training run 5) and levels long enough for
# DDTree's per-round gain to show (WAVES=8: at least 8 x C requests a level). Calls 3 and 4 of
# a lease whose calls 1-2 carried the GGUF's first parts (`.carry/q1` with `.whl`, then
# `.carry/q2`; `mkdir -p /root/parts && cp .carry/qN/* /root/parts/`); call 3 carries
# `.carry/q3`. Back to back:
#   bash bench/lease/spec_measure.sh exact   GPU tests of the speculation paths, T=1 at C=1/2
#   bash bench/lease/spec_measure.sh lossless  fp32 greedy == AR (b16k4, b8k2, b4k1): ~5 min
#                                            (fp32 through the engine is slow: in `exact` under
#                                            a 200 s limit it was cut, the eighth session)
#   bash bench/lease/spec_measure.sh load    C=1..64: AR, the DFlash engine at budget 0, fixed
#                                            budgets 3/7/16 (topk 4: the adaptive candidates),
#                                            adaptive; each config's rounds per budget
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
case ${1:-exact} in
exact)
    TAG=run5 timeout 200 bash bench/speculation.sh $R tests
    TAG=run5 CONFIGS=ar,dflash-b16k4,dflash-b8k2,dflash-b16k4@adaptive timeout 150 bash bench/speculation.sh $R sampled
    ;;
lossless)
    TAG=run5 timeout 570 bash bench/speculation.sh $R lossless
    ;;
load)
    TAG=run5 WAVES=8 CONFIGS=ar,dflash-b0,dflash-b3k4,dflash-b7k4,dflash-b16k4,dflash-b16k4@adaptive \
        timeout 540 bash bench/speculation.sh $R load
    ;;
esac
rm -f $R/*.png; tar czf $OUT/res-${1:-exact}.tgz -C /root res
