"""fast/kernels/dense/swiglu.py (and the model's torch twin ``mlp.swiglu_act_torch``) vs the activation of
reference/model/mlp.swiglu, ``silu(gate) * up``: NUMERIC (fp32 1e-5, bf16 2e-2, fp16 5e-3).

The input ``[N, 2I]`` (gate columns first) is a column slice of a wider NaN-poisoned buffer, so a read
outside a row's 2I columns makes the output non-finite; N in {1, 3, 8, 40} (both sides of the launcher's
small-row block), I in {5, 37, 300, 1100} (one to several column programs, a ragged last one), output in
the input dtype and in fp32. Both compute in fp32 and round once, so the twin is held to the reference
at the same bound, and in fp32 it is ``F.silu(gate) * up`` bit for bit (the values the engine had before
the kernel); the Triton launcher is held to the twin too (its exp and division are not IEEE; on CUDA in
bf16 within one bf16 ulp). The whole MLP ``act(x @ [W_gate; W_up].T) @ W_down.T`` is held to the
reference's ``swiglu``. Planted bug: gate and up swapped must fail. On CUDA a graph replay equals the
eager call bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.dense.swiglu import swiglu_act_triton
from dflash2.fast.kernels.dense.swiglu import swiglu_act, swiglu_act_torch
from dflash2.reference.model.mlp import swiglu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 5), (3, 37), (8, 300), (40, 1100)]  # N, I


def poisoned(values: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """``values [N, W]`` as the column slice ``[:, pad:pad+W]`` of a NaN buffer ``[N, W + 2 pad]``."""
    rows, width = values.shape
    buf = torch.full((rows, width + 2 * pad), float("nan"), dtype=values.dtype, device=values.device)
    buf[:, pad:pad + width] = values
    return buf[:, pad:pad + width]


def make_gate_up(rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 3
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # gates where exp(-g) overflows, saturates, is 1
    return gate_up


def reference_act(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().cpu().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(100): inf, as meant
@pytest.mark.parametrize("rows,width", SHAPES, ids=lambda v: str(v))
def test_swiglu_act_matches_reference(impl_device, report, rows, width):
    impl, device = impl_device
    fn = pick(impl, swiglu_act_torch, swiglu_act_triton)
    values = make_gate_up(rows, width, seed=rows * width)
    for dtype in DTYPES:
        gate_up = poisoned(values.to(device, dtype))
        for out_dtype in dict.fromkeys((dtype, torch.float32)):  # once for fp32
            name = f"{str(dtype)[6:]}->{str(out_dtype)[6:]}"
            out = fn(gate_up, out_dtype)
            assert out.dtype == out_dtype and out.shape == (rows, width) and out.is_contiguous()
            report.numeric(f"act/{name}", out, reference_act(gate_up), NUMERIC_BOUND[dtype])
            twin = swiglu_act_torch(gate_up, out_dtype)
            if impl == "triton":
                report.numeric(f"twin/{name}", out, twin, NUMERIC_BOUND[dtype])
                if device == "cuda" and out_dtype != torch.float32:  # one rounding of nearly the same fp32 value
                    spacing = twin.float().abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
                    assert bool(((out.float() - twin.float()).abs() <= spacing + 1e-30).all()), name
        assert fn(gate_up).dtype == dtype
    fp32 = poisoned(values.to(device))
    gate, up = fp32.chunk(2, dim=-1)
    assert torch.equal(swiglu_act_torch(fp32), F.silu(gate) * up), "fp32 twin differs from F.silu(gate) * up"


@pytest.mark.parametrize("rows,width", [(3, 37), (8, 300)], ids=lambda v: str(v))
def test_swiglu_mlp_matches_reference(impl_device, report, rows, width):
    """``act(x @ [W_gate; W_up].T) @ W_down.T`` against the reference's ``swiglu`` (fp32)."""
    impl, device = impl_device
    gen = torch.Generator().manual_seed(width)
    hidden = 24
    x = torch.randn(rows, hidden, generator=gen)
    w_gate, w_up = (torch.randn(width, hidden, generator=gen) * hidden ** -0.5 for _ in range(2))
    w_down = torch.randn(hidden, width, generator=gen) * width ** -0.5
    w_gate_up = torch.cat([w_gate, w_up]).to(device)
    act = pick(impl, swiglu_act_torch, swiglu_act_triton)(x.to(device) @ w_gate_up.T)
    got = act @ w_down.to(device).T
    expected = swiglu(x.double(), w_gate.double(), w_up.double(), w_down.double())
    report.numeric("mlp/float32", got, expected, NUMERIC_BOUND[torch.float32])


def test_swiglu_act_dispatch_on_cpu():
    """The model's entry point keeps the torch twin on CPU tensors (and on anything not [N, 2I])."""
    gate_up = make_gate_up(3, 9, seed=2)
    assert torch.equal(swiglu_act(gate_up), swiglu_act_torch(gate_up))
    three_d = gate_up.view(3, 1, 18)
    assert torch.equal(swiglu_act(three_d), swiglu_act_torch(gate_up).view(3, 1, 9))


def test_swiglu_act_refusals_and_empty(impl_device):
    impl, device = impl_device
    fn = pick(impl, swiglu_act_torch, swiglu_act_triton)
    assert fn(torch.zeros(0, 8, device=device)).shape == (0, 4)
    if impl == "torch":
        return
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_act_triton(torch.zeros(2, 3, 8, device=device))
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_act_triton(torch.zeros(2, 7, device=device))
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_act_triton(torch.zeros(8, 2, device=device).t())


def test_planted_bug_gate_and_up_swapped_is_caught(impl_device, report):
    impl, device = impl_device
    values = make_gate_up(3, 37, seed=4)
    width = values.shape[1] // 2
    swapped = torch.cat([values[:, width:], values[:, :width]], dim=1).to(device)
    out = pick(impl, swiglu_act_torch, swiglu_act_triton)(swapped)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("act/planted", out, reference_act(values), NUMERIC_BOUND[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_act_cuda_graph_replay_is_exact(dtype):
    """The draft's shape (8 rows of I = 5632) and a prefill-sized one: a replay equals the eager call."""
    for rows, width in ((8, 5632), (300, 5632)):
        gate_up = make_gate_up(rows, width, seed=rows).to("cuda", dtype)
        eager = swiglu_act(gate_up)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = swiglu_act(gate_up)
        for _ in range(2):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), f"{dtype} [{rows}, {width}]: the replay differs from eager"
