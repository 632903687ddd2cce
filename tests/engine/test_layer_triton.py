"""The fused layer kernels (ddserve.engine.layer_triton) equal the reference layer
(ddserve.engine.static.layer_step): the layer's output and every key/value written into the
pools, with and without q/k/v biases, for decode, tree and drafter-block shapes; and a static
engine on them decodes token for token like one without (its DFlash drafter keeps torch's
layers). Without a GPU the kernels run in triton's interpreter (tests/engine/triton_interpreter)."""

import os

import pytest
import torch

from tests.engine.triton_interpreter import (
    CUDA,
    DEV,
    DTYPES,
    interpreted,
    interpreter,  # noqa: F401  (autouse fixture)
    programs_out_of_order,
)

with interpreted():
    from ddserve.engine import layer_launch, layer_split
    from ddserve.engine.layer_triton import fused_layer_step

from ddserve.config.engine import LiveParams  # noqa: E402
from ddserve.engine import attention as A  # noqa: E402
from ddserve.engine.dflash import DFlashDrafter  # noqa: E402
from ddserve.engine.drafters import NoDrafter  # noqa: E402
from ddserve.engine.llama import Block, LlamaConfig, Rotary  # noqa: E402
from ddserve.engine.static import fuse_weights, fused_layers_on, layer_step  # noqa: E402
from ddserve.engine.static_engine import StaticEngine  # noqa: E402
from ddserve.engine.weights import random_llama  # noqa: E402
from ddserve.errors import ConfigError  # noqa: E402
from tests.engine.reference import decode_with_late_joiner  # noqa: E402
from tests.engine.test_batching import PROMPTS  # noqa: E402
from tests.engine.test_lossless import random_dflash  # noqa: E402

# hidden and intermediate sizes that are no multiple of the kernels' blocks (masked edges)
CFG = dict(
    vocab_size=512,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=3,
    num_kv_heads=1,
    head_dim=32,
    max_position=256,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def random_block(bias: bool, dtype, seed: int, head_dim: int = 32) -> Block:
    torch.manual_seed(seed)
    block = Block(LlamaConfig(**{**CFG, "head_dim": head_dim}, qkv_bias=bias))
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + ("norm" in name))
    block = block.to(DEV, dtype)
    fuse_weights(block)  # after the move: the fused matrices are plain tensors
    return block


# launch-parameter sets: the defaults, and qkv's rotary halves in column blocks of 16
# (head_dim 64: two blocks a half) with one-step K loops (block_k past the input width)
BLOCKS = {(k, bm): (16, 256, 4, 1) for k in ("qkv", "gate_up", "o", "down") for bm in (16, 64)}
# GEMV sets (block_n < 16: products summed on the CUDA cores, a program's rows the forward's
# up to layer_launch.GEMV_BLOCK_ROWS, 8): narrow column blocks with a K loop and masked K edges
# (block_k 64 over 96 and 160 inputs), and wider ones in one K step; every row class, so 12,
# 18 and 65 rows take several row blocks
GEMV = {(k, c): (4, 64, 4, 3) for k in ("qkv", "gate_up", "o", "down") for c in (16, 64)}
GEMV_ONE_STEP = {(k, c): (2 if k == "qkv" else 8, 256, 2, 1) for k, c in GEMV}
# split-K (ddserve.engine.layer_split): K loops of 32-column steps (96 inputs: 3 steps, 160:
# 5) spread over 3 programs a tile (down: 2 + 2 + 1 steps), tensor cores and GEMV
SPLIT_TC = {(k, c): (16, 32, 4, 1) for k in ("qkv", "gate_up", "o", "down") for c in (16, 64)}
SPLIT_GEMV = {(k, c): (4, 32, 2, 1) for k, c in SPLIT_TC}
SPLIT_ALL = {(k, c): 3 for k in ("qkv", "gate_up", "o", "down") for c in (1, 2, 4, 8, 16, 32, 64)}
VARIANTS = {
    "defaults": ({}, 32, {}),
    "blocks": (BLOCKS, 32, {}),
    "blocks-hd64": (BLOCKS, 64, {}),
    "gemv": (GEMV, 32, {}),
    "gemv-one-step-hd64": (GEMV_ONE_STEP, 64, {}),
    "split": (SPLIT_TC, 64, SPLIT_ALL),
    "split-gemv": (SPLIT_GEMV, 32, SPLIT_ALL),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request):
    tune, head_dim, splits = VARIANTS[request.param]
    layer_launch.TUNE.update(tune)
    layer_launch.SPLIT_K.update(splits)
    layer_split._SPACES.clear()  # this test's split kernels make their own workspace
    with programs_out_of_order():
        yield head_dim
    layer_launch.TUNE.clear()
    layer_launch.SPLIT_K.clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "b,w,mode,bias",
    [
        (1, 1, A.TREE, False),  # AR decode of one request
        (3, 4, A.TREE, True),  # a tree per row, q/k/v biases (Qwen2)
        (1, 2, A.TREE, False),  # 2 rows (AR of two requests, a tree of two nodes)
        (2, 2, A.TREE, False),  # 4 rows: the defaults' class mixing GEMV and tensor cores
        (2, 9, A.FULL, False),  # the drafter's block
        (5, 13, A.TREE, False),  # 65 rows: two row blocks of 64
    ],
)
def test_fused_layer_equals_reference(b, w, mode, bias, dtype, variant, request):
    if not CUDA and b * w > 64 and "gemv" in request.node.callspec.params["variant"]:
        # ~10 s each in the interpreter (a program per 4 columns x 5 row blocks); 18 rows
        # already take several GEMV row blocks there, and on a GPU this case runs
        pytest.skip("65 rows of GEMV sets: on a GPU only (CI time)")
    block = random_block(bias, dtype, seed=b * w, head_dim=variant)
    c = block.cfg
    gen = torch.Generator().manual_seed(7)
    slots, length = 6, 64
    pool = [
        torch.randn(slots, c.num_kv_heads, length, c.head_dim, generator=gen).to(DEV, dtype)
        for _ in range(2)
    ]
    x = torch.randn(b * w, c.hidden_size, generator=gen).to(DEV, dtype)
    rows = torch.randperm(slots, generator=gen)[:b].to(DEV)
    past = torch.randint(0, length - w - 1, (b,), generator=gen).to(DEV)
    wpos = past[:, None] + torch.arange(w, device=DEV)[None, :]
    cos, sin = Rotary(c.head_dim, 10000.0).to(DEV)(wpos.reshape(-1) + 3, dtype)
    tree = torch.ones(b, w, w, dtype=torch.long, device=DEV).tril()
    attn = A.plan("sdpa", past, mode, tree if mode == A.TREE else None, w, length, 3, dtype)
    outs = {}
    for name, fn in (("ref", layer_step), ("fused", fused_layer_step)):
        kc, vc = (p.clone() for p in pool)
        y = fn(block, x, cos, sin, kc, vc, rows, wpos, attn, True)
        outs[name] = (y.float(), kc.float(), vc.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for ref, mine in zip(outs["ref"], outs["fused"], strict=True):
        assert (ref - mine).abs().max().item() < tol
    if layer_launch.SPLIT_K:  # the split ran, and its finishers left every counter at zero
        spaces = [cnt for key, (_, cnt) in layer_split._SPACES.items() if key[0].startswith(DEV)]
        assert spaces and all(cnt.count_nonzero().item() == 0 for cnt in spaces)


def test_split_plan():
    """layer_split.plan: at most the splits asked for, each a nonempty run of whole block_k
    steps; their shares of a weight row prefetch where 16-byte aligned and >= 16 bytes."""
    plan = layer_split.plan
    assert plan(96, 32, 3, 192, 2) == (3, True)  # 3 steps, one each
    assert plan(160, 32, 3, 320, 2) == (3, True)  # 5 steps: 2 + 2 + 1
    assert plan(576, 256, 3, 1152, 2) == (3, True)  # the last share 64 columns
    assert plan(576, 256, 4, 1152, 2) == (3, True)  # no empty fourth
    assert plan(4 * 256, 256, 3, 2048, 2) == (2, True)  # 4 steps in 3: 2 + 2, not 2 + 2 + 0
    assert plan(576, 1024, 3, 1152, 2) == (1, True)  # one step: unsplit
    assert plan(96, 32, 1, 192, 2) == (1, True)
    assert plan(24, 4, 6, 48, 2) == (6, False)  # shares of 8 bytes: no prefetch
    assert plan(36, 16, 3, 72, 2) == (3, False)  # the last share 4 columns: 8 bytes
    assert plan(40, 16, 3, 80, 2) == (3, True)  # ... 8 columns: 16 bytes


# AR's forwards (1-4 rows) take the default GEMV sets; the GEMV sets of every class for the
# drafter's trees too (AR on them: ~45 s more in the interpreter, the same 1-4-row path)
@pytest.mark.parametrize(
    "drafter,sets",
    [("none", "defaults"), ("dflash", "defaults"), ("dflash", "gemv"), ("dflash", "split")],
)
def test_engine_on_fused_layers_decodes_like_the_reference(drafter, sets, monkeypatch):
    """Static engines with and without the fused layers, same model (fp32): the same greedy
    tokens and accept lengths, prompts prefilled through torch (wide) then decoded in one
    batch, a late joiner included; the DFlash drafter's layers stay torch's. With the
    default launch parameters, the GEMV sets and split-K (every class, 3 programs a tile)."""
    tune = {"gemv": GEMV, "split": SPLIT_TC}.get(sets, {})
    monkeypatch.setattr(layer_launch, "TUNE", dict(tune))
    monkeypatch.setattr(layer_launch, "SPLIT_K", SPLIT_ALL if sets == "split" else {})
    model = random_llama(LlamaConfig(**CFG), seed=3).to(DEV)
    params = LiveParams(budget=6, topk=2, window=8)
    draft = random_dflash(model) if drafter == "dflash" else None
    outs = {}
    for fused in ("off", "on"):
        d = DFlashDrafter(draft, model) if draft is not None else NoDrafter()
        eng = StaticEngine(
            model, d, 4, (), slots=4, max_context=128, graphs=CUDA, fused_layers=fused
        )
        assert eng.fused_layers == (fused == "on")
        with programs_out_of_order():
            outs[fused] = decode_with_late_joiner(eng, PROMPTS[:4], params, 10)
    assert outs["on"] == outs["off"]


def test_fused_layers_choice():
    """auto: on with CUDA only (never the interpreter); on without CUDA or the interpreter is
    a config error naming the fix; off is off."""
    dev, bf16, fp32 = torch.device(DEV), torch.bfloat16, torch.float32
    assert fused_layers_on("off", dev, bf16) is False
    assert fused_layers_on("auto", dev, bf16) is CUDA
    assert fused_layers_on("auto", dev, fp32) is False  # fp32: torch's layers are faster
    assert fused_layers_on("on", dev, fp32) is True  # asked for: the tests' oracle runs
    if not CUDA:
        del os.environ["TRITON_INTERPRET"]
        with pytest.raises(ConfigError, match="--fused-layers auto or off"):
            fused_layers_on("on", dev, fp32)


def captured(fn):
    """(a CUDA graph of fn(), its output), fn run once on a side stream first (warm-up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def pdl_chain_replays(
    pdl: bool,
    prefetch: bool,
    *,
    real_warmup: bool = True,
    fixed_cos: bool = False,
    same_inputs: bool = False,
    b: int = 4,
    w: int = 2,
) -> list[tuple[torch.Tensor, ...]]:
    """Twelve fused bf16 layers (triton attention, its keys split: the merge kernel in the
    chain) in one CUDA graph, launched with `pdl` and `prefetch` as given, replayed 20 times;
    per replay, (output, *pools). Every call builds the same layers, pools and inputs (fixed
    seeds). Each replay gets new tokens, committed lengths and write positions (copied in,
    as the engine does) and RoPE's cos/sin computed inside the graph just before the first
    layer. The warm-up runs on the first replay's inputs: with every write position 0, a
    row's two tokens would store their keys to one position, and which store wins is
    undefined (`real_warmup=False` does that, as a diagnosis: ddserve.bench.pdl_check, as
    are `fixed_cos`, cos/sin made once outside the graph, and `same_inputs`, every replay
    the first one's)."""
    dt = torch.bfloat16
    layers = [random_block(False, dt, seed=i, head_dim=64) for i in range(12)]
    c = layers[0].cfg
    length = 256  # b=4, w=2: 6 folded rows a program, 256 keys: four splits
    gen = torch.Generator().manual_seed(1)
    rotary = Rotary(c.head_dim, 10000.0).to(DEV)
    rows = torch.arange(b, device=DEV)
    past = torch.zeros(b, dtype=torch.long, device=DEV)  # inputs, refilled before each replay
    wpos = torch.zeros(b, w, dtype=torch.long, device=DEV)
    x_in = torch.zeros(b * w, c.hidden_size, device=DEV, dtype=dt)
    tree = torch.ones(b, w, w, dtype=torch.long, device=DEV).tril()
    attn = A.plan("triton", past, A.TREE, tree, w, length, c.num_heads // c.num_kv_heads, dt)
    shape = (b, c.num_kv_heads, length, c.head_dim)
    pools0 = [torch.randn(shape, generator=gen).to(DEV, dt) for _ in range(2 * len(layers))]
    steps = []
    for _ in range(20):
        p = torch.randint(8, length - w - 1, (b,), generator=gen)
        x = torch.randn(b * w, c.hidden_size, generator=gen).to(dt)
        if same_inputs and steps:
            steps.append(steps[0])
        else:
            steps.append((p.to(DEV), (p[:, None] + torch.arange(w)).to(DEV), x.to(DEV)))
    cos_sin = rotary(steps[0][1].reshape(-1), dt)

    def chain(pools):
        # kernels right before the first layer
        cos, sin = cos_sin if fixed_cos else rotary(wpos.reshape(-1), dt)
        x = x_in
        for i, block in enumerate(layers):
            kc, vc = pools[2 * i], pools[2 * i + 1]
            x = fused_layer_step(block, x, cos, sin, kc, vc, rows, wpos, attn, True)
        return x

    layer_launch.PDL, layer_launch.PREFETCH = pdl, prefetch
    try:
        pools = [p.clone() for p in pools0]
        if real_warmup:
            past.copy_(steps[0][0])
            wpos.copy_(steps[0][1])
            x_in.copy_(steps[0][2])
        graph, out = captured(lambda: chain(pools))
        seen = []
        for p, wp, x in steps:
            past.copy_(p)
            wpos.copy_(wp)
            x_in.copy_(x)
            graph.replay()
            seen.append((out.clone(), *(t.clone() for t in pools)))
        torch.cuda.synchronize()
        return seen
    finally:
        layer_launch.PDL = layer_launch.PREFETCH = None


@pytest.mark.skipif(
    not CUDA or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a Hopper-or-later GPU",
)
@pytest.mark.parametrize("sets", ["defaults", "blocks", "gemv", "defaults-1-row", "split"])
def test_pdl_chain_equals_serial_launches(sets):
    """The chain of `pdl_chain_replays` with programmatic dependent launch and L2
    prefetches and without either: the same bits in the output and in every pool after each
    of 20 replays, so a kernel that read before its predecessors' writes were visible would
    differ. 4 x 2 rows, and 1 row (AR at C=1: the default GEMV sets, which the engine
    overlaps). Split-K too: its partials and counters, shared by the chain's kernels, must
    be read only once every program of the tile has parked its partials."""
    layer_launch.TUNE.update({"blocks": BLOCKS, "gemv": GEMV, "split": SPLIT_TC}.get(sets, {}))
    layer_launch.SPLIT_K.update(SPLIT_ALL if sets == "split" else {})
    b, w = (1, 1) if sets == "defaults-1-row" else (4, 2)
    try:
        results = {o: pdl_chain_replays(o, o, b=b, w=w) for o in (False, True)}
    finally:
        layer_launch.TUNE.clear()
        layer_launch.SPLIT_K.clear()
    for serial, overlapped in zip(results[False], results[True], strict=True):
        for a, b_ in zip(serial, overlapped, strict=True):
            assert torch.equal(a, b_)


@pytest.mark.skipif(not CUDA, reason="a race between a GPU's programs: CUDA only")
def test_split_replays_are_deterministic():
    """Split-K on a GPU, where a tile's programs race: four SmolLM2-sized bf16 layers of 16
    rows (1 x 16 tree rows) in one CUDA graph, every kernel's K loop in 64-column steps over
    up to 8 programs a tile (qkv, gate/up, o: 9 steps, 5 splits; down: 24, 8), replayed 300
    times: the same bits every replay (the finisher sums in split order, whoever arrives
    last), close to the unsplit layers, and every counter back at zero."""
    cfg = {**CFG, "hidden_size": 576, "intermediate_size": 1536, "num_heads": 9}
    cfg.update(num_kv_heads=3, head_dim=64)
    dt, b, w = torch.bfloat16, 1, 16
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        block = Block(LlamaConfig(**cfg))
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.03) + ("norm" in name))
        block = block.to(DEV, dt)
        fuse_weights(block)
        layers.append(block)
    c = layers[0].cfg
    length = 256
    pools = [
        torch.randn(2, c.num_kv_heads, length, c.head_dim, device=DEV, dtype=dt)
        for _ in range(2 * len(layers))
    ]
    x = torch.randn(b * w, c.hidden_size, device=DEV, dtype=dt)
    rows = torch.arange(b, device=DEV)
    past = torch.full((b,), 100, device=DEV)
    wpos = past[:, None] + torch.arange(w, device=DEV)[None, :]
    cos, sin = Rotary(c.head_dim, 10000.0).to(DEV)(wpos.reshape(-1), dt)
    tree = torch.ones(b, w, w, dtype=torch.long, device=DEV).tril()
    attn = A.plan("triton", past, A.TREE, tree, w, length, 3, dt)

    def chain():
        y = x
        for i, block in enumerate(layers):
            y = fused_layer_step(block, y, cos, sin, pools[2 * i], pools[2 * i + 1], rows, wpos,
                                 attn, True)  # fmt: skip
        return y

    sets = {(k, 16): (16, 64, 4, 1) for k in layer_launch.KERNELS}
    try:
        layer_launch.TUNE.update(sets)
        layer_launch.SPLIT_K.update({(k, 16): 1 for k in layer_launch.KERNELS})  # unsplit
        plain = chain().float()
        layer_launch.SPLIT_K.update({(k, 16): 8 for k in layer_launch.KERNELS})
        graph, out = captured(chain)
        seen = []
        for _ in range(300):
            graph.replay()
            seen.append(out.clone())
        torch.cuda.synchronize()
    finally:
        layer_launch.TUNE.clear()
        layer_launch.SPLIT_K.clear()
    assert all(torch.equal(seen[0], s) for s in seen[1:])
    assert (seen[0].float() - plain).abs().max().item() < 0.1 * plain.abs().max().item()
    assert all(cnt.count_nonzero().item() == 0 for _, cnt in layer_split._SPACES.values())


def test_launch_parameters_by_row_class(monkeypatch):
    """A forward of m rows takes the entry of m rounded up to a power of two, else the next
    larger class up to its tile class (16 or 64 rows), TUNE's before DEFAULTS'; a GEMV set
    (block_n < 16) takes the forward's rows up to GEMV_BLOCK_ROWS (8) a program, a tensor-core
    set tiles of 16, 32 or 64; GEMV forwards of more than OVERLAP_MAX_GEMV_ROWS rows do not
    overlap."""
    L = layer_launch
    assert [L.rows_key(m) for m in (1, 2, 3, 4, 5, 9, 16, 17, 64, 65, 300)] == [
        1, 2, 4, 4, 8, 16, 16, 32, 64, 64, 64,
    ]  # fmt: skip
    assert [L.block_m(m, 4) for m in (1, 3, 8, 16, 40)] == [1, 4, 8, 8, 8]  # 16 rows: 2 blocks
    assert L.block_m(16, 16) == 16  # tensor-core tiles keep 16
    monkeypatch.setattr(L, "GEMV_BLOCK_ROWS", 16)
    assert [L.block_m(m, 4) for m in (1, 3, 16, 40)] == [1, 4, 16, 16]
    assert [L.block_m(m, 16) for m in (1, 16, 17, 40)] == [16, 16, 32, 64]
    monkeypatch.setattr(L, "TUNE", {})
    monkeypatch.setattr(L, "DEFAULTS", {("o", 2): "d2", ("o", 16): "d16", ("o", 64): "d64"})
    assert [L.launch_params("o", m) for m in (1, 2, 3, 8, 16, 17, 64)] == [
        "d2", "d2", "d16", "d16", "d16", "d64", "d64",
    ]  # fmt: skip
    L.TUNE[("o", 4)] = "t4"  # TUNE first, at any class up to the tile's
    assert [L.launch_params("o", m) for m in (1, 2, 4, 8, 32)] == ["t4", "t4", "t4", "d16", "d64"]
    # the overlap: on for GEMV at 1 row, off for GEMV at more, on for tensor-core sets
    gemv, tc = (4, 1024, 2, 1), (16, 128, 4, 3)
    sets = {(k, c): gemv if c <= 4 else tc for k in L.KERNELS for c in (1, 2, 4, 16, 64)}
    monkeypatch.setattr(L, "TUNE", sets)
    monkeypatch.setattr(L, "hopper", lambda device: True)
    on = [L.pdl_on(torch.device("cpu"), 0, 1, m) for m in (1, 2, 4, 8, 16)]
    assert on == [True, False, False, True, True]
    assert L.prefetch_on(torch.device("cpu"), 0, 1, 2) is False
    assert L.pdl_on(torch.device("cpu"), 0, 8, 1) is False  # more slots than OVERLAP_MAX_BATCH
    # split-K: the defaults' 3 programs a tile for qkv and gate/up in the 16-row class (9-16
    # rows) and gate/up in the 8-row one (5-8), o and down unsplit; SPLIT_K overrides them
    monkeypatch.setattr(L, "SPLIT_K", {})
    assert [L.split_k("gate_up", m) for m in (1, 4, 5, 8, 9, 16, 17)] == [1, 1, 3, 3, 3, 3, 1]
    assert [L.split_k("qkv", m) for m in (8, 9, 16, 17)] == [1, 3, 3, 1]
    assert [L.split_k(k, m) for k in ("o", "down") for m in (8, 16)] == [1, 1, 1, 1]
    L.SPLIT_K[("o", 16)] = 3
    L.SPLIT_K[("qkv", 16)] = 1
    assert L.split_k("o", 16) == 3 and L.split_k("qkv", 16) == 1
