"""Boot this machine's own root filesystem as a systemd container (systemd-nspawn over a
throwaway overlay: the host is never written), so units run under a real system manager.
PID 1 here is not systemd; see ../shared/notes/systemd-testing.md for the method."""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BOOT = r"""
set -e
mount -t tmpfs tmpfs /run
mount -t tmpfs -o size=2G tmpfs "$S/ovl" && mkdir "$S/ovl/upper" "$S/ovl/work"
mount -t overlay overlay -o lowerdir=/,upperdir="$S/ovl/upper",workdir="$S/ovl/work" "$S/root"
exec systemd-nspawn -D "$S/root" --register=no --keep-unit -M ddserve-test --console=read-only $BINDS -b -- \
  systemd.mask=postgresql.service systemd.mask=apt-daily.timer systemd.mask=apt-daily-upgrade.timer
"""


def available() -> bool:
    return shutil.which("systemd-nspawn") is not None and os.geteuid() == 0


class Container:
    def __init__(self, nspawn: subprocess.Popen, state: Path):
        self.nspawn, self.state = nspawn, state
        self.pid = None

    def find_init(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in Path("/proc").iterdir():
                if not p.name.isdigit():
                    continue
                try:
                    stat = (p / "stat").read_text()
                    cmd = (p / "cmdline").read_bytes().split(b"\0")[0]
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.nspawn.pid and cmd.endswith((b"systemd", b"init")):
                    self.pid = int(p.name)
                    return
            time.sleep(0.1)
        raise TimeoutError("the container's systemd did not start")

    def run(
        self, *cmd: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"{cmd} failed ({r.returncode}): {r.stdout[-1500:]} {r.stderr[-1500:]}"
            )
        return r

    def wait_running(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.3)
        raise TimeoutError(f"container systemd is {state!r}")


@contextlib.contextmanager
def booted(binds: list[str]):
    state = Path(tempfile.mkdtemp(prefix="ddserve-nspawn-"))
    (state / "ovl").mkdir()
    (state / "root").mkdir()
    env = {**os.environ, "S": str(state), "BINDS": " ".join(f"--bind={b}" for b in binds)}
    cg = Path("/sys/fs/cgroup/ddserve_test.slice/nspawn.scope")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", BOOT],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: _enter_cgroup(cg),
    )
    c = Container(proc, state)
    try:
        # nspawn is exec'd by bash in place, so `proc` becomes nspawn itself
        c.find_init()
        c.wait_running()
        yield c
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(state, ignore_errors=True)


def _enter_cgroup(cg: Path) -> None:
    dirs = (
        [cg]
        if Path("/sys/fs/cgroup/cgroup.controllers").exists()
        else [
            Path("/sys/fs/cgroup/systemd") / cg.relative_to("/sys/fs/cgroup"),
            Path("/sys/fs/cgroup/unified") / cg.relative_to("/sys/fs/cgroup"),
        ]
    )
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            pass
