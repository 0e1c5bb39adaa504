"""fast/kernels/dense/skinny_linear.py (the Triton launcher and its torch form) vs the exact product
``x @ W.T`` in float64 (every linear of reference/model is that line) and, with the SwiGLU epilogue,
vs reference/model/mlp.swiglu's activation: NUMERIC (fp32 1e-5, bf16 2e-2, fp16 5e-3; bf16 Triton on
CUDA only, as Triton 3.6's interpreter gets a bf16 tl.dot wrong).

Shapes: the draft's 8 rows and ragged ones (1, 3, 13 rows; 20 and 70 rows, two and more M tiles),
N not a multiple of the column tile, K not a multiple of BLOCK_K, K split into 1, 2, 3 and 4 ranges
(the last ragged, and a split count the K range cannot fill, which the launcher reduces). x is a
column slice of a NaN-poisoned buffer (row stride wider than K), so a read past a row's K columns
or past the last row makes the output non-finite; ``out`` is a column slice of a NaN buffer too, so
a write outside it shows. The Triton launcher is held to the torch form as well. Split-K's counters
must be zero again after every call (a second call with the same tiles gives the same bits), and on
CUDA a graph replay equals the eager call bit for bit, for split and unsplit configs. Planted bugs:
the gate and up halves swapped, and a split-K counter left nonzero, must fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.dense import skinny_linear as sl
from dflash2.fast.kernels.common import tickets
from dflash2.fast.kernels.dense.skinny_linear import (SkinnyConfig, skinny_linear, skinny_linear_torch,
                                                skinny_linear_triton)
from dflash2.reference.model.mlp import swiglu



def dtypes(impl: str, device: str) -> list[torch.dtype]:
    """Triton 3.6's interpreter computes a bf16 tl.dot wrongly (~1e10 off, seen here): bf16 on CUDA only."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if impl == "torch" or device == "cuda" else [])

# rows, N, K, config
CASES = [
    (8, 40, 96, SkinnyConfig(block_n=16, block_k=32, split_k=1)),
    (8, 40, 96, SkinnyConfig(block_n=16, block_k=32, split_k=3)),
    (1, 33, 200, SkinnyConfig(block_n=16, block_k=64, split_k=2)),  # ragged last K range (200 = 128 + 72)
    (3, 16, 130, SkinnyConfig(block_n=32, block_k=32, split_k=4)),
    (13, 50, 64, SkinnyConfig(block_n=16, block_k=64, split_k=4)),  # one K block: the launcher runs 1 split
    (20, 24, 80, SkinnyConfig(block_n=16, block_k=16, split_k=2)),  # one 32-row tile
    (70, 17, 48, SkinnyConfig(block_n=16, block_k=16, split_k=3)),  # two 64-row tiles
    (100, 40, 96, SkinnyConfig(block_n=32, block_k=32, split_k=2, block_m=128)),  # one 128-row tile, 28 rows masked
    (130, 24, 64, SkinnyConfig(block_n=16, block_k=32, split_k=1, block_m=128)),  # two 128-row tiles
    (8, 64, 1024, None),  # default_config: 16-column tiles, K split in 4 (256 columns each)
    # the L2 prefetch (compiled sm_90+ only; elsewhere the flag does nothing): N past the last column tile, and a
    # ragged last K range whose later chunks lie past K
    (8, 40, 256, SkinnyConfig(block_n=16, block_k=64, split_k=2, prefetch_k=1 << 20)),
    (3, 33, 200, SkinnyConfig(block_n=16, block_k=64, split_k=2, prefetch_k=1 << 20)),
    (8, 40, 512, SkinnyConfig(block_n=16, block_k=64, split_k=1, prefetch_k=128)),  # the first 128 columns only
]


def poisoned_rows(values: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """``values [M, K]`` as the column slice ``[:, pad:pad+K]`` of a NaN buffer ``[M + 1, K + 2 pad]``."""
    rows, width = values.shape
    buf = torch.full((rows + 1, width + 2 * pad), float("nan"), dtype=values.dtype, device=values.device)
    buf[:rows, pad:pad + width] = values
    return buf[:rows, pad:pad + width]


def make_inputs(rows: int, n: int, k: int, swiglu_out: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(2 * n if swiglu_out else n, k, generator=gen) * k ** -0.5
    return x, w


def exact(x: torch.Tensor, w: torch.Tensor, swiglu_out: bool) -> torch.Tensor:
    y = x.double().cpu() @ w.double().cpu().T
    if not swiglu_out:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def run(impl: str, x, w, swiglu_out, config):
    if impl == "torch":
        return skinny_linear_torch(x, w, swiglu_out)
    return skinny_linear_triton(x, w, swiglu_out, config=config)


@pytest.mark.parametrize("swiglu_out", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("rows,n,k,config", CASES, ids=lambda v: f"bn{v.block_n}-bk{v.block_k}-s{v.split_k}"
                         f"{f'-pf{v.prefetch_k}' if v.prefetch_k else ''}" if isinstance(v, SkinnyConfig)
                         else "default" if v is None else str(v))
def test_skinny_linear_matches_exact_product(impl_device, report, rows, n, k, config, swiglu_out):
    impl, device = impl_device
    x, w = make_inputs(rows, n, k, swiglu_out, seed=rows * n + k)
    want = exact(x, w, swiglu_out)
    for dtype in dtypes(impl, device):
        xd, wd = poisoned_rows(x.to(device, dtype)), w.to(device, dtype)
        got = run(impl, xd, wd, swiglu_out, config)
        assert got.dtype == dtype and got.shape == (rows, n)
        name = str(dtype)[6:]
        report.numeric(f"exact/{name}", got, want, NUMERIC_BOUND[dtype])
        if impl == "triton":
            report.numeric(f"twin/{name}", got, skinny_linear_torch(xd, wd, swiglu_out), NUMERIC_BOUND[dtype])
            again = run(impl, xd, wd, swiglu_out, config)  # the counters are zero again: same tiles, same bits
            assert torch.equal(again, got), f"{name}: a second call differs (a split-K counter left nonzero?)"


def test_skinny_linear_swiglu_matches_reference_mlp(impl_device, report):
    """``skinny(x, [W_gate; W_up], swiglu) @ W_down.T`` against the reference's ``swiglu`` (fp32)."""
    impl, device = impl_device
    gen = torch.Generator().manual_seed(3)
    rows, hidden, width = 8, 48, 40
    x = torch.randn(rows, hidden, generator=gen)
    w_gate, w_up = (torch.randn(width, hidden, generator=gen) * hidden ** -0.5 for _ in range(2))
    w_down = torch.randn(hidden, width, generator=gen) * width ** -0.5
    gate_up = torch.cat([w_gate, w_up]).to(device)
    act = run(impl, x.to(device), gate_up, True, SkinnyConfig(block_n=16, block_k=16, split_k=2))
    got = act @ w_down.to(device).T
    report.numeric("mlp/float32", got, swiglu(x.double(), w_gate.double(), w_up.double(), w_down.double()),
                   NUMERIC_BOUND[torch.float32])


def test_skinny_linear_writes_only_out(impl_device):
    """``out`` as a column slice of a NaN buffer: the slice is written whole, nothing around it."""
    impl, device = impl_device
    if impl == "torch":
        return
    x, w = make_inputs(8, 40, 96, False, seed=1)
    x, w = x.to(device), w.to(device)
    buf = torch.full((9, 50), float("nan"), device=device)
    out = buf[:8, 3:43]
    for config in (SkinnyConfig(block_n=16, block_k=32), SkinnyConfig(block_n=16, block_k=32, split_k=3)):
        buf.fill_(float("nan"))
        skinny_linear_triton(x, w, out=out, config=config)
        assert torch.isfinite(out).all()
        rest = buf.clone()
        rest[:8, 3:43] = 0
        assert rest.isnan().sum() == buf.numel() - out.numel()


def test_skinny_linear_refusals_and_empty(impl_device):
    impl, device = impl_device
    fn = pick(impl, skinny_linear_torch, skinny_linear_triton)
    assert fn(torch.zeros(0, 8, device=device), torch.zeros(4, 8, device=device)).shape == (0, 4)
    with pytest.raises(ValueError, match="expected \\[M, K\\] and \\[N, K\\]"):
        fn(torch.zeros(2, 8, device=device), torch.zeros(4, 7, device=device))
    with pytest.raises(ValueError, match="swiglu needs"):
        fn(torch.zeros(2, 8, device=device), torch.zeros(5, 8, device=device), True)
    with pytest.raises(ValueError, match="one float dtype"):
        fn(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device, dtype=torch.float16))
    if impl == "torch":
        return
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear_triton(torch.zeros(2, 8, device=device), torch.zeros(8, 4, device=device).t())
    with pytest.raises(ValueError, match="unit column stride"):
        skinny_linear_triton(torch.zeros(8, 2, device=device).t(), torch.zeros(4, 8, device=device))
    with pytest.raises(ValueError, match="out"):
        skinny_linear_triton(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device),
                             out=torch.zeros(2, 5, device=device))


def test_skinny_linear_dispatch():
    """CPU tensors take the torch form; on CUDA an untuned shape (or a row count outside its measured range)
    takes cuBLAS, a tuned one the kernel with the config measured on that GPU."""
    x, w = make_inputs(3, 8, 16, False, seed=2)
    assert torch.equal(skinny_linear(x, w), skinny_linear_torch(x, w))
    assert torch.equal(skinny_linear(x, torch.cat([w, w]), True), skinny_linear_torch(x, torch.cat([w, w]), True))
    assert sl.tuned_config(8, 512, 2048, False, torch.device("cpu")) is None
    if not torch.cuda.is_available():
        return
    xc, wc = x.cuda(), w.cuda()
    assert torch.equal(skinny_linear(xc, wc), xc @ wc.T)  # [8, 16] is not in the table
    cfg = sl.tuned_config(8, 2048, 5632, False, xc.device)
    if "H200" in torch.cuda.get_device_name():
        assert cfg == sl.H200_TUNED[(2048, 5632, False)][1]
        assert sl.tuned_config(64, 2048, 5632, False, xc.device) is None  # measured up to 32 rows
    xt = torch.randn(8, 5632, device="cuda").bfloat16()
    wt = torch.randn(2048, 5632, device="cuda").bfloat16()
    want = skinny_linear_triton(xt, wt, config=cfg) if cfg is not None else xt @ wt.T
    assert torch.equal(skinny_linear(xt, wt), want)


def test_tuned_entries_are_row_ranges_and_configs_the_launcher_takes():
    """Every TUNED entry: rows 1 <= fewest <= most, a config the launcher takes (powers of two, tiles >= 16)."""
    for gpu, shapes in sl.TUNED.items():
        for (n, k, fused), entries in shapes.items():
            for fewest, most, cfg in entries:
                assert 1 <= fewest <= most, (gpu, n, k, fused)
                for size in (cfg.block_n, cfg.block_k, cfg.block_m or 16):
                    assert size >= 16 and size & (size - 1) == 0, (gpu, n, k, cfg)


def test_planted_bug_gate_and_up_swapped_is_caught(impl_device, report):
    impl, device = impl_device
    x, w = make_inputs(8, 24, 64, True, seed=5)
    swapped = torch.cat([w[24:], w[:24]]).to(device)
    got = run(impl, x.to(device), swapped, True, SkinnyConfig(block_n=16, block_k=32, split_k=2))
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("swiglu/planted", got, exact(x, w, True), NUMERIC_BOUND[torch.float32])


def test_planted_bug_a_stale_counter_is_caught(impl_device, report):
    """A split-K counter left nonzero (the failure the reset exists for) makes a program sum before the
    last partial is stored: the result must fail the comparison. In the interpreter, whose programs run
    one after another; on a GPU the early sum may still see every partial (perf7 call 1: it did)."""
    impl, device = impl_device
    if impl == "torch" or device == "cuda":  # on a GPU the splits run at once: which one sums early is a race
        return
    x, w = make_inputs(8, 16, 96, False, seed=6)
    x, w = x.to(device), w.to(device)
    config = SkinnyConfig(block_n=16, block_k=32, split_k=3)
    want = exact(x, w, False)
    report.numeric("split/clean", skinny_linear_triton(x, w, config=config), want, NUMERIC_BOUND[torch.float32])
    counters = tickets.ticket_counters(x.device, 1)  # the buffer the call below uses (lane 0)
    try:
        counters[0] = 1  # one ticket already drawn: the second program to arrive takes the last one
        got = skinny_linear_triton(-1.5 * x, w, config=config)  # other values: a stale workspace cannot pass
        with pytest.raises(AssertionError):
            report.numeric("split/planted", got, -1.5 * want, NUMERIC_BOUND[torch.float32])
    finally:
        counters.zero_()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("prefetch", [0, 256, 1 << 20], ids=["", "prefetch256", "prefetch"])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("swiglu_out", [False, True], ids=["linear", "swiglu"])
def test_skinny_linear_cuda_graph_replay_is_exact(split_k, swiglu_out, prefetch):
    """The draft's shapes at one request (8 rows): a replay equals the eager call, twice (the counters
    are zero again after each replay); with the L2 prefetch, the bits of the same tiles without it."""
    for n, k in ((512, 2048), (2048, 5632)):
        x, w = make_inputs(8, n, k, swiglu_out, seed=n)
        x, w = x.to("cuda", torch.bfloat16), w.to("cuda", torch.bfloat16)
        config = SkinnyConfig(block_n=16, block_k=256, split_k=split_k, prefetch_k=prefetch)
        eager = skinny_linear_triton(x, w, swiglu_out, config=config)  # compiles outside the capture
        plain = skinny_linear_triton(x, w, swiglu_out, config=SkinnyConfig(block_n=16, block_k=256, split_k=split_k))
        assert torch.equal(eager, plain), f"[8, {n}, {k}] split {split_k}: the prefetch changed the result"
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = skinny_linear_triton(x, w, swiglu_out, config=config)
        for _ in range(3):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), f"[8, {n}, {k}] split {split_k}: the replay differs from eager"
