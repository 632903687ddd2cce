# Install Ray on the lent GPU machine from the pieces bench/device_pack.sh made, once all
# three parts of its wheel are in /root/parts (and the Serve extras beside them); sourced
# after bench/device_env.sh:
#   . bench/device_ray.sh
# puts Ray under /tmp/site2 and on PYTHONPATH and PATH.
wheel=/root/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
if [ ! -f /tmp/site2/.done ]; then
    cat /root/parts/ray.part0 /root/parts/ray.part1 /root/parts/ray.part2 >"$wheel" &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site2 "$wheel" /root/parts/*.whl && touch /tmp/site2/.done
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site2 PATH=/tmp/site2/bin:$PATH
