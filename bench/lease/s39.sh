# For the thirty-fourth session: adaptive speculation timed from full trips. s38 (this
# session's first lease, results/upkeep/h100-s38/) found adaptive at C=16 on b15 in ~85% of
# trips at 0.91x fixed b7's tok/s, its own estimates saying b15 beat b7 by 23% where b7's
# rounds were cheaper: a candidate re-tried on a one-round call (a newcomer's first token)
# carried the call's whole host round trip. Now only calls of --num-scheduler-steps rounds
# time a candidate (adaptive.FULL_TRIPS_ONLY). Side by side in one call: AR, fixed b7 and
# adaptive at C=2/16/64, then adaptive with every trip timed (the s38 code) at C=16/64. Not
# run in the thirty-fourth session (its starts after s38 failed); ~110 s of calls 1-2 and a
# fresh machine, then ~450 s for call 3 (first engine ~98 s to ready, adaptive's ~60 s).
# Calls 1-2 as s37/s38 (carry .carry/r1 .whl, then .carry/r2), then:
#   3  carry .carry/r3
case ${CALL:?} in
[12]) exec bash bench/lease/s37.sh ;;
esac
. bench/lease/load_env.sh
timeout 300 python3 -m ddserve.bench.engine_load $LOAD --concurrency 2,16,64 \
    --configs ar@steps4,dflash-b7k4@steps4,dflash-b15k4@adaptive@steps4 --name full_trips \
    2>&1 | quiet | table
echo '{"engine": {"FULL_TRIPS_ONLY": false}}' >/tmp/old.json
timeout $((${END:-450} - SECONDS)) python3 -m ddserve.bench.tuned /tmp/old.json \
    ddserve.bench.engine_load $LOAD --concurrency 16,64 \
    --configs dflash-b15k4@adaptive@steps4 --name every_trip 2>&1 | quiet | table
echo "done at ${SECONDS}s"
