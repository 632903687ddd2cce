"""A prompt chunk's attention on the GPU (issue 18: what a long prefill spends in attention):
W new tokens of one request after P committed keys, causal, SmolLM2's heads (9 query heads,
3 kv heads, 64 dims), bf16, read from the engine's KV pool layout [slots, kv heads, L, dims].

    python -m ddserve.bench.prefill_attention [--cases 0:2048,2048:2048,5120:2048,0:7200]
        [--name prefill_attention] [--out bench/results]

Side by side for each case (P:W), GPU time by CUDA events (median of 3 runs of 20 calls):
  * triton   ddserve.engine.attention_triton (the engine's kernel, CAUSAL mode), its default
             launch, the same with its keys unsplit, and a sweep of block sizes / warps /
             stages;
  * sdpa-*   torch's scaled_dot_product_attention on the same pool slice, one backend at a
             time (flash, cudnn, efficient), GQA by `enable_gqa`, the causal mask aligned
             to the last key (torch.nn.attention.bias.causal_lower_right) when P > 0.
TFLOP/s counts QK^T and PV over the visible keys only. Writes NAME.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

NH, KVH, HD = 9, 3, 64
DTYPE = torch.bfloat16


def timed(fn, n: int = 20) -> float:
    """Median over 3 runs of n calls, ms per call (after 3 untimed calls)."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / n)
    return sorted(runs)[1]


def case(past: int, w: int, dev) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from ddserve.engine.attention import CAUSAL
    from ddserve.engine.attention_triton import launch

    length = 1 << (past + w - 1).bit_length()
    kc = torch.randn(1, KVH, length, HD, device=dev, dtype=DTYPE)
    vc = torch.randn_like(kc)
    q = torch.randn(w, NH, HD, device=dev, dtype=DTYPE)
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    pastt = torch.full((1,), past, dtype=torch.long, device=dev)
    visible = sum(past + t + 1 for t in range(w))
    flop = 4 * HD * NH * visible
    res = {"past": past, "new": w, "tflop": round(flop / 1e12, 4), "variants": {}}

    qs = q.transpose(0, 1).unsqueeze(0)  # [1, nh, W, hd], a view of the engine's layout
    keys, values = kc[:, :, : past + w], vc[:, :, : past + w]
    mask = causal_lower_right(w, past + w) if past else None

    def sdpa():
        if mask is None:
            return F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)

    # the reference: fp32 math on the same inputs, [W, nh, hd]
    with sdpa_kernel([SDPBackend.MATH]):
        k32 = keys.float().repeat_interleave(NH // KVH, 1)
        v32 = values.float().repeat_interleave(NH // KVH, 1)
        bias = torch.ones(w, past + w, dtype=torch.bool, device=dev).tril(past)
        ref = F.scaled_dot_product_attention(qs.float(), k32, v32, attn_mask=bias)[0]
    ref = ref.transpose(0, 1)

    def record(name, fn, rows_first=True):
        try:
            out = fn()
            ms = timed(fn)
        except Exception as e:  # a backend or launch that does not take these inputs: why
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            return
        out = out if rows_first else out[0].transpose(0, 1)
        err = (out.float() - ref).abs().max().item()
        res["variants"][name] = {
            "ms": round(ms, 4),
            "tflops": round(flop / ms / 1e9, 1),
            "max_abs_err": round(err, 5),
        }

    record("triton", lambda: launch(q, kc, vc, rows, pastt, None, None, w, CAUSAL, length))
    # the same launch with its keys unsplit (no partials, no merge)
    record(
        "triton 1 split",
        lambda: launch(q, kc, vc, rows, pastt, None, None, w, CAUSAL, length, splits=1),
    )
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        tune = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        record(
            f"triton m{bm} n{bn} w{warps} s{stages}",
            lambda t=tune: launch(q, kc, vc, rows, pastt, None, None, w, CAUSAL, length, **t),
        )
    for name, be in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def run(be=be):
            with sdpa_kernel([be]):
                return sdpa()

        record(f"sdpa-{name}", run, rows_first=False)
    # the fastest variant whose error stays within bf16's (a wrong launch is not a winner)
    ok = [(v["ms"], k) for k, v in res["variants"].items() if v.get("max_abs_err", 1) < 0.05]
    res["best"] = min(ok)[1] if ok else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="0:1024,0:2048,2048:2048,5120:2048,0:7200")
    ap.add_argument("--name", default="prefill_attention")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.prefill_attention times GPU kernels: it needs a GPU")
    dev = torch.device("cuda")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python -m ddserve.bench.prefill_attention " + " ".join(sys.argv[1:]),
        "cases": [],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in a.cases.split(","):
        past, w = (int(x) for x in spec.split(":"))
        res = case(past, w, dev)
        result["cases"].append(res)
        (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
        v = res["variants"]
        print(
            f"P={past:5d} W={w:5d}: triton {v['triton'].get('ms')} ms "
            f"({v['triton'].get('tflops')} TF/s); best {res['best']} {v[res['best']]}; "
            + "; ".join(
                f"{k} {v[k].get('ms', v[k].get('error', '')[:60])}"
                for k in v
                if k.startswith("sdpa")
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
