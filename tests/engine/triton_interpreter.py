"""The engine's triton kernels under test without a GPU: in triton's interpreter (numpy on the
CPU), which is how CI runs them; on a GPU the same tests run the compiled kernels.

A kernel test module imports its kernel modules inside `interpreted()` (triton decides at
decoration, i.e. at import, whether a kernel is interpreted) and imports the `interpreter`
fixture, which sets the variable again for each of its tests. Outside those two the variable
is as it was: engine processes other tests start must never inherit it (they would run every
kernel interpreted)."""

import contextlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


@contextlib.contextmanager
def interpreted():
    """TRITON_INTERPRET=1 while the kernel modules are imported (off CUDA), then as before."""
    was = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("TRITON_INTERPRET", None)


with interpreted():
    triton = pytest.importorskip("triton")
    if not CUDA:
        import triton.runtime.interpreter as _interp

        # triton 3.6's interpreter turns a scalar (a 1-element array there) into a Python int
        # with int(array), which numpy >= 2.4 refuses for arrays of one dimension; loops over
        # runtime bounds (`range(lo, hi)`) need it
        _patch = _interp._patch_lang_tensor

        def _patch_index(tensor, scope):
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_index


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Each test of a kernel module runs with the interpreter (off CUDA)."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def programs_out_of_order():
    """Off CUDA: the interpreter runs each launch's programs with grid axis 2 outermost and
    descending, axes 0 and 1 descending within it (it runs axis 2 innermost, ascending):
    programs that must meet, split-K's (ddserve.engine.layer_split), then arrive apart, other
    tiles' between them, and the last split first, as on a GPU they may. On CUDA: nothing."""
    if CUDA:
        yield
        return
    builder = _interp.InterpreterBuilder
    plain = builder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        k = (x * ny + y) * nz + z  # the k-th program the interpreter runs
        plane = nx * ny
        r = plane - 1 - k % plane
        plain(self, r // ny, r % ny, nz - 1 - k // plane)

    builder.set_grid_idx = set_grid_idx
    try:
        yield
    finally:
        builder.set_grid_idx = plain
