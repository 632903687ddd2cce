"""The package's shape: one import root, imports that run one way, a wheel that installs.

The import graph is read from the source (every `import`, function-local ones included), so a
cycle held together by a deferred import still fails here.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from ddserve.backends.process import free_port

ROOT = Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, Path]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    out = {}
    for pkg in tool["packages"]:
        head = max((k for k in mapping if pkg == k or pkg.startswith(k + ".")), key=len)
        out[pkg] = ROOT / mapping[head] / Path(*pkg[len(head) :].split(".")[1:])
    return out


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, d in _package_dirs().items():
        for f in d.glob("*.py"):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file."""
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + [base])
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, []) if sub in MODULES else (base, [a.name]))
    return [(m, names) for m, names in out if m == "ddserve" or m.startswith("ddserve.")]


def _graph() -> dict[str, set[str]]:
    return {m: {i for i, _ in _imports(m, p) if i != m} for m, p in MODULES.items()}


def test_every_package_has_its_files():
    assert "ddserve.cli" in MODULES and "ddserve.engine.runner" in MODULES
    assert all(p.exists() for p in MODULES.values())


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strongconnect(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert cycles == []


def test_cli_modules_are_leaves():
    offenders = [
        (m, i)
        for m, deps in _graph().items()
        if not m.startswith("ddserve.cli") and m != "ddserve.__main__"  # the entry point
        for i in deps
        if i == "ddserve.cli" or i.startswith("ddserve.cli.")
    ]
    assert offenders == []


def test_no_private_name_imported_across_packages():
    offenders = []
    for m, p in MODULES.items():
        home = m if p.stem == "__init__" else m.rpartition(".")[0]
        for mod, names in _imports(m, p):
            there = mod if MODULES.get(mod, Path()).stem == "__init__" else mod.rpartition(".")[0]
            offenders += [(m, mod, n) for n in names if n.startswith("_") and there != home]
    assert offenders == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    return next(out.glob("ddserve-*.whl"))


def test_wheel_has_one_import_root_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ddserve", "ddserve-0.1.0.dist-info"}
    for data in [
        "ddserve/deploy/default.yaml",
        "ddserve/deploy/smollm2-gpu.yaml",
        "ddserve/deploy/kimi-tp8.yaml",
        "ddserve/deploy/prometheus.yml",
        "ddserve/dashboards/ddserve.json",
        "ddserve/dashboards/provisioning/dashboards/ddserve.yaml",
        "ddserve/engine/dflash_weights/smollm2-135m/model.safetensors",
        "ddserve/reconfig/controller.py",
        "ddserve/systemd/units.py",
        "ddserve/cli/__init__.py",
    ]:
        assert data in names
    meta = zipfile.ZipFile(wheel).read("ddserve-0.1.0.dist-info/METADATA").decode()
    assert "Requires-Dist: torch==2.13.0" in meta


@pytest.mark.slow
def test_wheel_serves_without_the_checkout(wheel, tmp_path):
    """Installed (not editable) into a fresh venv, run from elsewhere: the CLI finds its own
    package data and a real engine answers."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import ddserve.deploy as d, ddserve.config.deploy as c; "
            "print(d.DEFAULT_CONFIG); print(c.load_config(d.DEFAULT_CONFIG).name)",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()
    assert where[0].startswith(str(env_dir)) and where[1]
    ddserve = env_dir / "bin" / "ddserve"
    port = free_port()
    proc = subprocess.Popen(
        [
            str(ddserve),
            "engine",
            "--model",
            "tiny-random",
            "--drafter",
            "ngram",
            "--port",
            str(port),
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline
            time.sleep(0.5)
        r = subprocess.run(
            [
                str(ddserve),
                "chat",
                "hello",
                "--url",
                f"http://127.0.0.1:{port}",
                "--max-tokens",
                "4",
            ],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert "fingerprint" in r.stderr
    finally:
        proc.terminate()
        proc.wait(10)


def test_no_merge_conflict_markers_left():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    marked = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".json"}:
            continue
        lines = path.read_text(errors="replace").splitlines()
        if any(ln.startswith(("<<<<<<< ", ">>>>>>> ")) for ln in lines):
            marked.append(name)
    assert marked == []
