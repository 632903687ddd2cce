"""Run a bench module with the fused layer kernels tuned by a bench.layer_kernels run: its
best launch parameters per row block, and the row limit raised to what its whole-layer
timings won (bench.layer_kernels.apply_tune), in this process, then the module as `-m`.

    python -m ddserve.bench.tuned LAYER_KERNELS_JSON[,JSON...] MODULE [ARGS...]

For a lease that measures the engine with parameters an earlier call of the same lease
found, before they are written into layer_triton.DEFAULTS."""

from __future__ import annotations

import runpy
import sys

from ddserve.bench.layer_kernels import apply_tune


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m ddserve.bench.tuned LAYER_KERNELS_JSON MODULE [ARGS...]")
    path, module, *args = sys.argv[1:]
    print(f"ddserve.bench.tuned: {apply_tune(path)}", file=sys.stderr, flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
