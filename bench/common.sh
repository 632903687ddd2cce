# Shell helpers of the bench/*.sh drivers (sourced, not run). Needs $py (the python to use).

wait_url() {  # URL: until a real answer on /v1/models (10 minutes at most; exit 1 then)
    $py - "$1" <<'PY'
import sys, time, httpx
for _ in range(1200):
    try:
        httpx.get(sys.argv[1] + "/v1/models", timeout=1).raise_for_status()
        sys.exit(0)
    except httpx.HTTPError:
        time.sleep(0.5)
sys.exit(1)
PY
}
