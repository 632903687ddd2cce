"""bench.round_profile's GPU split: a trace's kernels by the phase that launched them."""

from ddserve.bench.round_profile import kernel_split


def _x(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_kernels_go_to_the_phase_whose_range_launched_them():
    events = [
        _x("user_annotation", "ddserve:draft", 0, 10),
        _x("cuda_runtime", "cudaGraphLaunch", 5, 2, corr=1),
        _x("user_annotation", "ddserve:verify", 20, 10),
        _x("cuda_runtime", "cudaGraphLaunch", 25, 2, corr=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 40, 2, corr=3),  # outside both: other
        # the GPU runs them later than their launches; two draft kernels, one overlapping
        _x("kernel", "draft_a", 100, 30, corr=1),
        _x("kernel", "draft_b", 120, 20, corr=1),
        _x("kernel", "verify_a", 150, 50, corr=2),
        _x("kernel", "verify_a", 200, 50, corr=2),
        _x("gpu_memcpy", "Memcpy DtoH", 260, 10, corr=3),
        _x("kernel", "unlinked", 300, 4),
        {"ph": "M", "name": "process_name"},
    ]
    out = kernel_split(events, rounds=2, wall_ms=0.2)
    ph = out["phases"]
    assert ph["draft"]["gpu_ms"] == (30 + 20) / 1e3 / 2
    assert ph["draft"]["launches"] == 1.0
    assert ph["verify"]["top"] == [{"kernel": "verify_a", "us": 50.0, "count": 1.0}]
    assert ph["other"]["gpu_ms"] == (10 + 4) / 1e3 / 2
    # busy is the union: draft 100-140, verify 150-250, copy 260-270, 300-304
    assert out["gpu_busy_ms"] == (40 + 100 + 10 + 4) / 1e3 / 2
    assert out["gpu_idle_ms"] == round(0.2 - 0.077, 4)
