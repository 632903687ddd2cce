"""The engine's split kernels and its GPU tree build compile for a Hopper GPU (sm_90) here,
without one: triton's
compiler down to PTX (and ptxas, which triton ships), in a process of its own (the kernel
tests run triton's interpreter, which tolerates what the compiler may refuse: a value that
changes type in a branch, a shape it cannot lay out). The PTX says what the GPU will run:
split-K counts programs in with one acq_rel atomic a program, unsplit
kernels have none. (The tree build of 2026-12-06 passed every interpreter test and did not
compile: a loop variable changed type; the engine fell back to host trees on the GPU.)"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# not imported here: a triton imported outside the interpreter's variable breaks the
# interpreted kernel tests that run after this module (the compiler runs in a subprocess)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ddserve.engine import layer_triton as LT

target = GPUTarget("cuda", 90, 32)


def ptx(fn, sig, consts, **opts):
    sig = {**sig, **{c: "constexpr" for c in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=target, options=opts).asm["ptx"]


def atoms(text):
    return sum("atom.global" in line and "acq_rel" in line for line in text.splitlines())


bf, i32 = "*bf16", "i32"
mm = dict(A=bf, Wt=bf, R=bf, Out=bf, WS="*fp32", Cnt="*i32", M=i32, N=i32, K=i32, sa=i32,
          sw=i32, sr=i32, so=i32)
gu = dict(X=bf, NW=bf, Wgu=bf, Out=bf, WS="*fp32", Cnt="*i32", M=i32, H=i32, INTER=i32,
          eps="fp32", sx=i32, sw=i32, so=i32)
qkv = dict(X=bf, NW=bf, Wqkv=bf, Bias=bf, Cos=bf, Sin=bf, Q=bf, KC=bf, VC=bf, Rows="*i64",
           Wpos="*i64", WS="*fp32", Cnt="*i32", M=i32, H=i32, W=i32, NH=i32, KVH=i32,
           eps="fp32", sx=i32, sw=i32, sc=i32, sq_n=i32, sq_h=i32, sk_s=i32, sk_h=i32,
           sk_l=i32)
out = {}
for split in (1, 3):
    tc = dict(IEEE=False, GEMV=False, BLOCK_M=16, PDL=True, SPLIT=split)
    out[f"o/{split}"] = atoms(ptx(LT._matmul_add, mm, dict(tc, BLOCK_N=16, BLOCK_K=128,
                                  PREFETCH=1152), num_warps=4, num_stages=3))
    out[f"down-gemv/{split}"] = atoms(ptx(LT._matmul_add, mm, dict(tc, GEMV=True, BLOCK_M=1,
                                          BLOCK_N=4, BLOCK_K=512, PREFETCH=3072), num_warps=2))
    out[f"gate_up/{split}"] = atoms(ptx(LT._gate_up, gu, dict(tc, BLOCK_N=32, BLOCK_K=256,
                                        PREFETCH=1152), num_warps=4))
    out[f"qkv/{split}"] = atoms(ptx(LT._qkv_rope, qkv, dict(tc, HD=64, HAS_BIAS=False,
                                    BLOCK_N=32, BLOCK_K=256, PREFETCH=1152), num_warps=8))
from ddserve.engine import tree_triton as TT
from ddserve.engine.tree import size_bound

types = ["*fp64", "*i64", "*i64", "*i64", "*i64", "*i64", "*i64", "*fp64", "*i64"] + [i32] * 5
for budget, depth, k, width in ((1, 1, 1, 2), (15, 16, 4, 16), (63, 16, 8, 64)):
    steps = size_bound(budget, depth, k)
    consts = dict(W=width, F=triton.next_power_of_2(2 * steps + 1))
    ptx(TT._build, dict(zip(TT._build.arg_names, types)), consts, num_warps=4)
    out[f"tree/{budget}"] = 0
print(json.dumps(out))
"""


def test_split_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    atoms = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("o", "down-gemv", "gate_up", "qkv"):
        assert atoms[f"{name}/1"] == 0, name  # unsplit: as before, no atomics
        assert atoms[f"{name}/3"] == 1, name  # split: one count a program
    # the GPU tree build: the engine's start-up probe's shape (1 node), b15/k4's, b63/k8's
    assert {"tree/1", "tree/15", "tree/63"} <= set(atoms)
