import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--budget", "-1"], "params.budget=-1"),
        (["--topk", "0"], "params.topk=0"),
        (["--top-p", "1.5"], "params.top_p=1.5"),
        (["--drafter", "magic"], "drafter.kind='magic'"),
        (["--model", "no-such-model"], "unknown model"),
    ],
)
def test_bad_engine_arguments_exit_nonzero_with_one_line(args, needle):
    r = subprocess.run(
        [sys.executable, "-m", "ddserve", "engine", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddserve: error:") and needle in lines[0], (
        r.stderr
    )
