# Shell helpers of the bench/*.sh drivers (sourced, not run). Needs $py (the python to use).

wait_url() {  # URL [PID]: until a real answer on /v1/models (10 minutes at most; exit 1 then,
    # or at once when the server process PID has exited: a server that failed to start)
    $py - "$1" "${2:-0}" <<'PY'
import os, sys, time, httpx
pid = int(sys.argv[2])
for _ in range(1200):
    try:
        httpx.get(sys.argv[1] + "/v1/models", timeout=1).raise_for_status()
        sys.exit(0)
    except httpx.HTTPError:
        if pid:
            try:
                os.kill(pid, 0)  # bash reaps its exited background jobs: then it is gone
            except ProcessLookupError:
                sys.exit(1)
        time.sleep(0.5)
sys.exit(1)
PY
}

ray_up() {  # LEG CFG LOG: `ddserve up --config CFG` (its output to LOG); on failure one line
    # naming LEG and the log's tail, and a non-zero status
    if $py -m ddserve up --config "$2" >"$3" 2>&1; then
        return 0
    fi
    echo "$1: up failed"; tail -5 "$3"
    return 1
}

ray_down() {  # CFG LOG: the application deleted and the Ray head `up` started stopped
    $py -m ddserve down --config "$1" --stop-ray >>"$2" 2>&1
}
