"""fast/kernels/moe/moe.py and the model's torch form vs reference/model/moe.routed_experts, computed in
float64: odd sizes (C = 48, I = 40 in I tiles of 16 and C steps of 32, E = 7, k = 3), N in {1, 5, 17}
rows routed unevenly (two experts never chosen, expert 0 chosen by every row: 17 rows are two
chunks of 16, in a different slot per row; experts repeat across rows, never within one). NUMERIC
per dtype; EXACT between two runs (the kernels write each partial product once and sum in a fixed
order); the output and partials buffers poisoned with NaN. Planted bugs (gate and up swapped, one
row routed off by one expert) must fail. On CUDA, a CUDA-graph replay must equal the eager call bit
for bit, at the released model's shapes too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, MoECase as Case, pick

from dflash2.fast.kernels.moe.moe import MoEBlocks, default_blocks, moe_experts_triton
from dflash2.fast.kernels.moe.moe import moe_experts, moe_experts_torch
from dflash2.reference.model.moe import routed_experts

HIDDEN, WIDTH, EXPERTS, TOP_K = 48, 40, 7, 3
SMALL = MoEBlocks(block_m=16, block_i=16, block_k=32, block_c=32, pair_tile=16, sum_block_c=32)
SMALL_SPLIT = MoEBlocks(block_m=16, block_i=16, block_k=32, block_c=32, pair_tile=16, sum_block_c=32, split=True,
                        block_d=16)  # the split form: I = 40 in three steps of 16, C = 48 in two tiles of 32
POPULARITY = torch.tensor([0.0, 4.0, 2.0, 1.0, 0.5, 0.0, 0.0])  # the choices besides expert 0; 5 and 6 unused




def make_case(rows: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=gen)
    others = torch.multinomial(POPULARITY.expand(rows, -1), TOP_K - 1, replacement=False, generator=gen)
    chosen = torch.cat([torch.zeros(rows, 1, dtype=torch.long), others], dim=1)  # [N, k], distinct per row
    slot_order = torch.argsort(torch.rand(rows, TOP_K, generator=gen), dim=1)
    expert_ids = chosen.gather(1, slot_order)
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=gen), dim=-1)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) * WIDTH ** -0.5
    expected = routed_experts(x.double(), expert_ids, weights.double(), gate_up.double(), down.double())
    return Case(x, expert_ids, weights, gate_up, down, expected)


def run(impl: str, args: tuple[torch.Tensor, ...], blocks: MoEBlocks | None = None) -> torch.Tensor:
    """The implementation under test; the Triton launcher writes into NaN-poisoned buffers."""
    if impl == "torch":
        return moe_experts_torch(*args)
    x, expert_ids = args[0], args[1]
    blocks = default_blocks(x.shape[0]) if blocks is None else blocks
    tiles = 1 if blocks.split else -(-args[3].shape[1] // 2 // blocks.block_i)
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), device=x.device)
    partials = torch.full((expert_ids.numel(), tiles, x.shape[1]), float("nan"), device=x.device)
    return moe_experts_triton(*args, blocks=blocks, out=out, partials=partials)


def dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_moe_matches_reference(impl_device, report, rows):
    impl, device = impl_device
    case = make_case(rows, seed=rows)
    assert int((case.expert_ids == 0).sum()) == rows and not torch.isin(case.expert_ids, torch.tensor([5, 6])).any()
    for dtype in dtypes(device):
        args = case.inputs(device, dtype)
        for blocks in [SMALL, SMALL_SPLIT, None] if impl == "triton" else [None]:
            got = run(impl, args, blocks)
            assert got.dtype == torch.float32 and got.shape == (rows, HIDDEN)
            what = f"y/{str(dtype)[6:]}" + {id(SMALL): "/small", id(SMALL_SPLIT): "/split"}.get(id(blocks), "")
            report.numeric(what, got, case.expected, NUMERIC_BOUND[dtype])
            if impl == "triton" or device == "cpu":  # the torch form's index_add_ on CUDA adds in any order
                assert torch.equal(run(impl, args, blocks), got), "two runs differ"


def test_moe_repeated_expert_within_a_row(impl_device, report):
    """Outside top-k's contract but well defined: each (row, choice) pair counts once, as the torch form does."""
    impl, device = impl_device
    case = make_case(5, seed=9)
    expert_ids = case.expert_ids.clone()
    expert_ids[1:3, 1] = expert_ids[1:3, 0]
    x, gate_up, down = case.x.double(), case.gate_up.double(), case.down.double()
    expected = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(TOP_K):
            gate, up = (gate_up[expert_ids[n, j]] @ x[n]).chunk(2)
            expected[n] += case.weights[n, j].double() * (down[expert_ids[n, j]] @ (F.silu(gate) * up))
    args = (case.x.to(device), expert_ids.to(device), case.weights.to(device), case.gate_up.to(device),
            case.down.to(device))
    for blocks in [SMALL, SMALL_SPLIT] if impl == "triton" else [None]:
        report.numeric("y/float32", run(impl, args, blocks), expected, NUMERIC_BOUND[torch.float32])


def test_moe_default_op_dispatch_on_cpu():
    """The model's op keeps the torch form on CPU (the engine's CPU path), bit for bit."""
    args = make_case(5, seed=11).inputs("cpu", torch.float32)
    assert torch.equal(moe_experts(*args), moe_experts_torch(*args))


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("planted", ["gate_up_swapped", "routed_off_by_one"])
def test_moe_planted_bugs_are_caught(impl_device, planted, split):
    impl, device = impl_device
    if split and impl != "triton":
        pytest.skip("the split form is the Triton launcher's")
    case = make_case(5, seed=7)
    x, expert_ids, weights, gate_up, down = case.inputs(device, torch.float32)
    if planted == "gate_up_swapped":
        gate_up = torch.cat([gate_up[:, WIDTH:], gate_up[:, :WIDTH]], dim=1)
    else:
        expert_ids = expert_ids.clone()
        expert_ids[2] = (expert_ids[2] + 1) % EXPERTS  # still distinct within the row
    blocks = (SMALL_SPLIT if split else SMALL) if impl == "triton" else None
    got = run(impl, (x, expert_ids, weights, gate_up, down), blocks).double().cpu()
    rms_rel = float((got - case.expected).pow(2).mean().sqrt() / case.expected.pow(2).mean().sqrt())
    assert rms_rel > 100 * NUMERIC_BOUND[torch.float32], f"the planted bug ({planted}) passes NUMERIC: {rms_rel:.1e}"


@pytest.mark.parametrize("bad", ["x", "gate_up", "down", "expert_ids", "weights", "dtype", "partials", "ready"])
def test_moe_bad_input_names_the_argument(bad):
    x, expert_ids, weights, gate_up, down = make_case(2, seed=3).inputs("cpu", torch.float32)
    kwargs = {}
    if bad == "x":
        x = x[None]
    elif bad == "gate_up":
        gate_up = gate_up[:, :-1]
    elif bad == "down":
        down = down[:, :, :-1]
    elif bad == "expert_ids":
        expert_ids = expert_ids.float()
    elif bad == "weights":
        weights = weights[:, :-1]
    elif bad == "dtype":
        down = down.double()
    elif bad == "partials":
        kwargs["partials"] = torch.zeros(1)
    else:
        kwargs["ready"] = torch.zeros(EXPERTS - 1, dtype=torch.int32)  # one counter short
    with pytest.raises(ValueError, match="down torch.float64" if bad == "dtype" else bad):
        moe_experts_triton(x, expert_ids, weights, gate_up, down, **kwargs)


def test_moe_no_rows(impl_device):
    impl, device = impl_device
    x, expert_ids, weights, gate_up, down = make_case(1, seed=5).inputs(device, torch.float32)
    got = pick(impl, moe_experts_torch, moe_experts_triton)(x[:0], expert_ids[:0], weights[:0], gate_up, down)
    assert got.shape == (0, HIDDEN) and got.dtype == torch.float32


def _graph_replay_equals_eager(args: tuple[torch.Tensor, ...], blocks: MoEBlocks | None = None,
                               ready: torch.Tensor | None = None) -> torch.Tensor:
    eager = moe_experts_triton(*args, blocks=blocks, ready=ready)  # compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts_triton(*args, blocks=blocks, ready=ready)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_triton(*args, blocks=blocks, ready=ready)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), "the graph replay differs from the eager call"
    return eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_moe_cuda_graph_replay_is_exact_and_the_default_op_dispatches_to_it():
    case = make_case(17, seed=13)
    for dtype in (torch.float32, torch.bfloat16):
        args = case.inputs("cuda", dtype)
        assert torch.equal(moe_experts(*args), _graph_replay_equals_eager(args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the released shapes run in the GPU lane")
@pytest.mark.parametrize("form", ["fused", "split", "overlap"])
@pytest.mark.parametrize("rows", [1, 8, 16, 128])
def test_moe_at_released_shapes(report, rows, form):
    """Qwen3.5-35B-A3B's experts (C = 2048, I = 512, E = 256, k = 8) in bf16, routed by a softmax over
    random logits: NUMERIC against the torch form in fp32, exact under graph replay; every form at
    each row count's default tiles; the overlapped split form bit for bit the split form, its counters
    left zero."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, width, experts, top_k = 2048, 512, 256, 8
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(rows, experts, device="cuda", generator=gen) * 2, dim=-1)
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    gate_up = (torch.randn(experts, 2 * width, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    down = (torch.randn(experts, hidden, width, device="cuda", generator=gen) * width ** -0.5).bfloat16()
    args = (x, expert_ids, weights, gate_up, down)
    blocks = replace(default_blocks(rows), split=form != "fused", overlap=form == "overlap")
    ready = torch.zeros(experts, dtype=torch.int32, device="cuda") if form == "overlap" else None
    got = _graph_replay_equals_eager(args, blocks, ready)
    if form == "overlap":
        assert int(ready.count_nonzero()) == 0, "the call left a ready counter set"
        assert torch.equal(got, moe_experts_triton(*args, blocks=replace(blocks, overlap=False)))
    expected = moe_experts_torch(x.float(), expert_ids, weights, gate_up.float(), down.float())
    report.numeric("y/bfloat16", got, expected, NUMERIC_BOUND[torch.bfloat16])


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_moe_overlapped_split_form_is_the_split_form(impl_device, rows):
    """``MoEBlocks.overlap`` with a ``ready`` buffer: the split form's bits, twice in a row on one buffer (the
    call leaves it all zero; a nonzero counter would let a down program read h early), and without the buffer
    the plain split form. (The race it guards against needs a GPU: test_moe_at_released_shapes, test_pdl.py.)"""
    impl, device = impl_device
    if impl == "torch":
        pytest.skip("the overlapped form is the Triton launcher's")
    args = make_case(rows, seed=23).inputs(device, torch.float32)
    ready = torch.zeros(EXPERTS, dtype=torch.int32, device=device)
    split = moe_experts_triton(*args, blocks=SMALL_SPLIT)
    for _ in range(2):
        got = moe_experts_triton(*args, blocks=replace(SMALL_SPLIT, overlap=True), ready=ready)
        assert torch.equal(got, split)
        assert int(ready.count_nonzero()) == 0
    assert torch.equal(moe_experts_triton(*args, blocks=replace(SMALL_SPLIT, overlap=True)), split)


def test_moe_out_dtype_rounds_the_fp32_sum_once(impl_device):
    """``out_dtype``: the kernel stores its fp32 sum rounded to bf16: on CUDA bit for bit the fp32 result
    cast by torch (both round to nearest even); Triton 3.6's interpreter truncates instead, so on the
    CPU each value is within one bf16 ulp of the cast."""
    impl, device = impl_device
    if impl == "torch":
        pytest.skip("out_dtype is the Triton launcher's")
    args = make_case(5, seed=41).inputs(device, torch.float32)
    full = moe_experts_triton(*args)
    got = moe_experts_triton(*args, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    if device == "cuda":
        assert torch.equal(got, full.to(torch.bfloat16))
    else:
        ulp = 2.0 ** -7 * full.abs()  # one bf16 ulp is at most 2^-7 of the value
        assert bool(((got.float() - full).abs() <= ulp).all())
