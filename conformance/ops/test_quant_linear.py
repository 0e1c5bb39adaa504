"""fast/kernels/quant: the fused dequant-matmul of a few rows (``quant_matmul``: the Triton kernel and its torch
twin, dequantize + matmul) against the exact product ``x @ W^T`` in float64 of the dequantized weights
(gguf-py's values: test_quant_dequant.py holds the dequantization to them bit for bit), NUMERIC per x's dtype
(fp32 1e-5, fp16 5e-3; bf16 2e-2 on CUDA only, Triton 3.6's interpreter getting bf16 wrong), the kernel against
its twin too, and ``quant_linear``'s choice between the fused kernel and dequantize + dense matmul.

Every type on random blocks; W rows 3, 5 and 40 (ragged tiles of 16 and 32 rows), K of one to three blocks
(256, 512, 768; Q8_0 96 and 256); x rows 1 (the one-row paths: no dot), 3, 8 and 17 (one 16- or 32-row tile of a
dot); K split in 1, 2 and 3 ranges (a ragged last one). Then every path under every tiling: rows 1, 2, 16 and 64
(the one-row paths; the verify dot at its 16- and 64-row tiles) against an odd R (ragged 16- and 64-row tiles),
in 64-row programs unsplit, split in 3 (a ragged last split), 16-row programs split in 2, and the default. x is a
column slice of a NaN-poisoned buffer, so a read outside its rows or K columns shows; ``out`` a slice of a NaN
buffer, so a write outside it shows. A second call gives the same bits (split-K's counters reset; no atomics
on values). Planted bugs (the bytes' nibbles swapped, d and dmin swapped) must fail NUMERIC on the one-row and
the verify path. On CUDA, a CUDA-graph replay equals the eager call bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import NUMERIC_BOUND
from test_quant_dequant import TRITON_DEVICES, col_sizes, make_weight

from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.quant import quant_linear as ql
from dflash2.fast.kernels.quant.dequant_torch import dequantize_torch
from dflash2.fast.kernels.quant.layout import QUANT_TYPES, Q, QuantWeight
from dflash2.fast.kernels.quant.quant_matmul import (MAX_ROWS, QuantMatmulConfig, quant_matmul, quant_matmul_experts,
                                                     quant_matmul_experts_torch, quant_matmul_experts_triton,
                                                     quant_matmul_torch, quant_matmul_triton)

X_ROWS = (1, 3, 8, 17)
SPLIT2 = QuantMatmulConfig(block_r=16, split_k=2)


def cases(qtype) -> list[tuple[int, int, QuantMatmulConfig | None]]:
    """(W rows, K, config): the default config; 16-row tiles and K in two; a ragged third split (3 blocks)."""
    small, large = col_sizes(qtype)
    ragged = 96 if qtype == Q.Q8_0 else 768
    return [(3, large, None), (40, small, SPLIT2), (5, ragged, QuantMatmulConfig(block_r=32, split_k=2))]


def dtypes(impl: str, device: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if impl == "torch" or device == "cuda" else [])


def poisoned_rows(values: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """``values [M, K]`` as the column slice ``[:, pad:pad+K]`` of a NaN buffer ``[M + 1, K + 2 pad]``."""
    rows, width = values.shape
    buf = torch.full((rows + 1, width + 2 * pad), float("nan"), dtype=values.dtype, device=values.device)
    buf[:rows, pad:pad + width] = values
    return buf[:rows, pad:pad + width]


def exact(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """``x @ W^T`` in float64 of x as given and gguf-py's (fp32) values of W."""
    return x.double().cpu() @ dequantize_torch(qw.to("cpu")).double().T


def run(impl: str, x: torch.Tensor, qw: QuantWeight, config=None) -> torch.Tensor:
    return quant_matmul_torch(x, qw) if impl == "torch" else quant_matmul_triton(x, qw, config)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_fused_matches_exact_product(impl_device, report, qtype):
    impl, device = impl_device
    gen = torch.Generator().manual_seed(int(qtype))
    for i, (rows, k, config) in enumerate(cases(qtype)):
        qw = make_weight(qtype, (rows, k), seed=200 + i)[0].to(device)
        for n in X_ROWS:
            x = torch.randn(n, k, generator=gen)
            for dtype in dtypes(impl, device):
                xd = poisoned_rows(x.to(device, dtype))
                got = run(impl, xd, qw, config)
                assert got.dtype == dtype and got.shape == (n, rows)
                what = f"{qtype.name}/{rows}x{k}/n{n}/{str(dtype)[6:]}"
                report.numeric(what, got, exact(xd, qw), NUMERIC_BOUND[dtype])
                if impl == "triton":
                    report.numeric(what + "/twin", got, quant_matmul_torch(xd, qw), NUMERIC_BOUND[dtype])
                    if n == 8:  # the counters are zero again: same tiles, same bits
                        assert torch.equal(run(impl, xd, qw, config), got), f"{what}: a second call differs"


PATH_CONFIGS = (None, QuantMatmulConfig(block_r=64, num_warps=2), QuantMatmulConfig(block_r=64, split_k=3),
                QuantMatmulConfig(block_r=16, split_k=2, num_warps=1))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_every_path_and_tiling(device, report, qtype):
    """Rows 1, 2, 16, 64 against R = 37 and K of three tiles, each of PATH_CONFIGS, fp32 and fp16: NUMERIC against
    the exact product and the twin, and a second call gives the same bits."""
    k = 96 if qtype == Q.Q8_0 else 768
    qw = make_weight(qtype, (37, k), seed=400)[0].to(device)
    gen = torch.Generator().manual_seed(400)
    for n in (1, 2, 16, 64):
        x = torch.randn(n, k, generator=gen)
        for dtype in (torch.float32, torch.float16):
            xd = poisoned_rows(x.to(device, dtype))
            want, twin = exact(xd, qw), quant_matmul_torch(xd, qw)
            for config in PATH_CONFIGS:
                got = quant_matmul_triton(xd, qw, config)
                what = f"{qtype.name}/n{n}/{str(dtype)[6:]}/{config}"
                report.numeric(what, got, want, NUMERIC_BOUND[dtype])
                report.numeric(what + "/twin", got, twin, NUMERIC_BOUND[dtype])
                assert torch.equal(quant_matmul_triton(xd, qw, config), got), f"{what}: a second call differs"


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_fused_writes_only_out(device):
    """``out`` as a column slice of a NaN buffer: the slice is written whole, nothing around it."""
    qw = make_weight(Q.Q4_K, (40, 512), seed=1)[0].to(device)
    x = torch.randn(3, 512, device=device)
    buf = torch.full((4, 50), float("nan"), device=device)
    out = buf[:3, 5:45]
    for config in (QuantMatmulConfig(block_r=16), SPLIT2):
        buf.fill_(float("nan"))
        quant_matmul_triton(x, qw, config, out=out)
        assert torch.isfinite(out).all()
        assert int(buf.isnan().sum()) == buf.numel() - out.numel()


def test_refusals_and_empty(impl_device):
    impl, device = impl_device
    qw = make_weight(Q.Q8_0, (5, 96), seed=1)[0].to(device)
    assert run(impl, torch.zeros(0, 96, device=device), qw).shape == (0, 5)
    with pytest.raises(ValueError, match="expected \\[N, K\\] and \\[R, K\\]"):
        run(impl, torch.zeros(2, 64, device=device), qw)
    with pytest.raises(ValueError, match="expected one of"):
        run(impl, torch.zeros(2, 96, device=device, dtype=torch.float64), qw)
    if impl == "torch":
        return
    with pytest.raises(ValueError, match="MAX_ROWS"):
        quant_matmul_triton(torch.zeros(MAX_ROWS + 1, 96, device=device), qw)
    with pytest.raises(ValueError, match="unit column stride"):
        quant_matmul_triton(torch.zeros(96, 2, device=device).t(), qw)
    with pytest.raises(ValueError, match="not a block type"):
        quant_matmul_triton(torch.zeros(2, 8, device=device), make_weight(Q.F16, (3, 8))[0].to(device))


# -- quant_linear and the op's dispatch -----------------------------------------------------------

def test_quant_linear_picks_by_rows(monkeypatch):
    """At the real bounds: FUSED_MAX_ROWS rows take the fused op once, one more row the fused op in slices of
    FUSED_MAX_ROWS, CHUNKED_MAX_ROWS + 1 rows dequantize + matmul (the forms replaced by recorders: the choice
    alone is under test here); leading dimensions are flattened; float types always take the dense path."""
    calls = []
    monkeypatch.setattr(ql, "quant_matmul", lambda x, qw: calls.append(("fused", x.shape[0])) or
                        torch.zeros(x.shape[0], qw.rows))
    real = ql.dequantize
    monkeypatch.setattr(ql, "dequantize", lambda qw, dtype: calls.append(("dequantize", dtype)) or real(qw, dtype))
    qw = make_weight(Q.Q4_K, (5, 256), seed=2)[0]
    bound = ql.FUSED_MAX_ROWS
    assert ql.quant_linear(torch.zeros(bound, 256), qw).shape == (bound, 5)
    assert ql.quant_linear(torch.zeros(bound + 1, 256), qw).shape == (bound + 1, 5)
    top = ql.CHUNKED_MAX_ROWS
    assert ql.quant_linear(torch.zeros(top + 1, 256, dtype=torch.float16), qw).shape == (top + 1, 5)
    assert ql.quant_linear(torch.zeros(2, 3, 256), qw).shape == (2, 3, 5)
    f16 = make_weight(Q.F16, (5, 32), seed=2)[0]
    assert ql.quant_linear(torch.zeros(1, 32), f16).shape == (1, 5)
    assert calls == [("fused", bound), ("fused", bound), ("fused", 1), ("dequantize", torch.float16), ("fused", 6),
                     ("dequantize", torch.float32)]


def test_sliced_rows_equal_their_slices():
    """The middle path: each FUSED_MAX_ROWS-row slice of x gives the bits quant_matmul gives it alone (a row's
    output reads its own row only), so a verify batch's rows do not depend on how many share the step."""
    qw = make_weight(Q.Q6_K, (7, 256), seed=4)[0]
    x = torch.randn(ql.FUSED_MAX_ROWS * 2 + 3, 256, generator=torch.Generator().manual_seed(4))
    got = ql.quant_linear(x, qw)
    for i in range(0, x.shape[0], ql.FUSED_MAX_ROWS):
        assert torch.equal(got[i:i + ql.FUSED_MAX_ROWS], quant_matmul(x[i:i + ql.FUSED_MAX_ROWS], qw))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_quant_linear_under_forced_gpu(device, report):
    """Under forced_gpu (the interpreter on the CPU): 3 rows through the fused kernel, 70 through it in two slices
    (quant_linear's middle path), both NUMERIC against the exact product; the op itself picks the kernel for at
    most MAX_ROWS rows."""
    qw = make_weight(Q.IQ4_XS, (24, 256), seed=3)[0].to(device)
    gen = torch.Generator().manual_seed(3)
    for n in (3, 70):
        x = torch.randn(n, 256, generator=gen).to(device)
        with forced_gpu():
            got = ql.quant_linear(x, qw)
            assert (quant_matmul.pick(x, qw) is quant_matmul.torch_form) == (n > MAX_ROWS)
        report.numeric(f"quant_linear/n{n}", got, exact(x, qw), NUMERIC_BOUND[torch.float32])
    cpu = qw.to("cpu")
    assert quant_matmul.pick(x[:3].cpu(), cpu) is quant_matmul.torch_form  # CPU tensors, nothing forced: the twin


# -- routed experts (stacked [E, R, K], one expert a row) ---------------------------------------------------

def exact_experts(x: torch.Tensor, qw: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    w = dequantize_torch(qw.to("cpu")).double()
    return torch.stack([x[p].double().cpu() @ w[int(ids[p])].T for p in range(x.shape[0])])


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_experts_match_exact_product(impl_device, report, qtype):
    """7 pairs over 4 experts (one chosen three times, one twice): each row against its expert, NUMERIC; the
    kernel split and unsplit (the default tiles, and 16-row tiles in two splits), and a planted bug (every id one
    off) must fail."""
    impl, device = impl_device
    k = col_sizes(qtype)[1]
    qw = make_weight(qtype, (4, 40, k), seed=300)[0].to(device)
    ids = torch.tensor([2, 0, 2, 3, 0, 1, 2], device=device)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(300))
    for dtype in dtypes(impl, device):
        xd = poisoned_rows(x.to(device, dtype))
        want = exact_experts(xd, qw, ids)
        configs = [None] if impl == "torch" else [None, SPLIT2]
        for config in configs:
            got = (quant_matmul_experts_torch(xd, qw, ids) if impl == "torch"
                   else quant_matmul_experts_triton(xd, qw, ids, config))
            assert got.dtype == dtype and got.shape == (7, 40)
            report.numeric(f"experts/{qtype.name}/{str(dtype)[6:]}", got, want, NUMERIC_BOUND[dtype])
    wrong = (ids + 1) % 4
    got = quant_matmul_experts(x.to(device), qw, wrong)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("experts/planted", got, exact_experts(x, qw, ids), NUMERIC_BOUND[torch.float32])


def test_experts_op():
    """CPU calls take the twin (not capturable: it reads the ids on the host); refusals name the argument."""
    qw = make_weight(Q.Q4_K, (2, 16, 256), seed=1)[0]
    x, ids = torch.randn(3, 256), torch.tensor([1, 0, 1])
    assert quant_matmul_experts.pick(x, qw, ids) is quant_matmul_experts.torch_form
    assert not quant_matmul_experts.capturable("cpu")
    with pytest.raises(ValueError, match="stacked"):
        quant_matmul_experts_torch(x, qw[0], ids)
    with pytest.raises(ValueError, match="expert_ids"):
        quant_matmul_experts_torch(x, qw, ids[:2])


# -- planted bugs -------------------------------------------------------------------------------------

def swap_nibbles(qw: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Every block's bytes start..stop with their two nibbles exchanged (a decoder reading the wrong half)."""
    data = qw.data.clone().reshape(-1, 144)
    data[:, start:stop] = (data[:, start:stop] >> 4) | (data[:, start:stop] << 4)
    return QuantWeight(data.reshape(qw.data.shape), qw.qtype, qw.shape)


def swap_d_dmin(qw: QuantWeight) -> QuantWeight:
    data = qw.data.clone().reshape(-1, 144)
    data[:, 0:4] = torch.cat([data[:, 2:4], data[:, 0:2]], dim=1)
    return QuantWeight(data.reshape(qw.data.shape), qw.qtype, qw.shape)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("plant", ["nibble_order", "d_dmin_swapped"])
def test_planted_bugs_are_caught(impl_device, report, plant, rows):
    """The product computed from Q4_K bytes read wrongly (what a decoder with the bug would compute) fails
    NUMERIC against the true weight's exact product, on the one-row path and the verify path."""
    impl, device = impl_device
    qw = make_weight(Q.Q4_K, (16, 256), seed=9)[0].to(device)
    wrong = swap_nibbles(qw, 16, 144) if plant == "nibble_order" else swap_d_dmin(qw)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(9)).to(device)
    report.numeric("clean", run(impl, x, qw, SPLIT2), exact(x, qw), NUMERIC_BOUND[torch.float32])
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric(plant, run(impl, x, wrong, SPLIT2), exact(x, qw), NUMERIC_BOUND[torch.float32])


# -- CUDA -----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.IQ3_XXS], ids=lambda t: t.name)
def test_cuda_graph_replay_is_exact(qtype):
    """bf16 x, split and unsplit: a graph replay equals the eager call bit for bit (the split-K counters)."""
    qw = make_weight(qtype, (1000, 2048), seed=5)[0].to("cuda")
    x = torch.randn(8, 2048, device="cuda").bfloat16()
    for config in (QuantMatmulConfig(block_r=32), QuantMatmulConfig(block_r=32, split_k=4)):
        eager = quant_matmul_triton(x, qw, config)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            quant_matmul_triton(x, qw, config)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = quant_matmul_triton(x, qw, config)
        for _ in range(2):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), f"{config}: the graph replay differs from the eager call"
