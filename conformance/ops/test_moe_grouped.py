"""fast/kernels/moe/moe_grouped.py (the routed experts of a long prefill as a grouped GEMM) vs the op's torch form
``moe_experts_torch`` and reference/model/moe.routed_experts computed in float64.

Shapes at odd sizes (C = 48 in C tiles of 32, I = 40 in I tiles and steps of 16), routings that stress the
alignment: experts never chosen, one expert holding every pair, P = N k not a multiple of block_m, many experts
with one or two pairs each (the padded length near its bound), one row. NUMERIC per dtype (fp32 and fp16 under
the CPU interpreter, whose bf16 arithmetic is not the GPU's; bf16 too on CUDA); EXACT between two calls; the
out, h and partials buffers poisoned with NaN. The alignment step EXACT against its written-out twin and a
worked example. Planted bugs (gate and up swapped, one block given the wrong expert) must fail. The op sends
calls of more than MAX_TRITON_PAIRS pairs here, at that boundary exactly. On CUDA, a CUDA-graph replay (the
alignment included) equals the eager call bit for bit, at the released model's prefill shapes too."""

from __future__ import annotations

import os

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, MoECase as Case

from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON, INTERPRETED
from dflash2.fast.kernels.moe import moe, moe_grouped
from dflash2.fast.kernels.moe.moe import moe_experts, moe_experts_gpu, moe_experts_torch
from dflash2.fast.kernels.moe.moe_grouped import (ExpertAlignment, GroupedBlocks, align_by_expert,
                                                  align_by_expert_torch, max_blocks, moe_experts_grouped)
from dflash2.reference.model.moe import routed_experts

HIDDEN, WIDTH = 48, 40
TINY = GroupedBlocks(block_m=16, block_i=16, block_c=32, block_k=16, sum_block_c=32)




def make_case(routing: str, seed: int = 0) -> Case:
    """``uneven``: 13 rows, k = 3 of E = 7, expert 0 in every row, experts 5 and 6 never (P = 39);
    ``one_expert``: 21 rows, k = 1 of E = 5, all on expert 3 (two blocks, one part padding);
    ``scattered``: 6 rows, k = 8 of E = 32 (most experts one or two pairs: a block each);
    ``one_row``: 1 row, k = 2 of E = 4."""
    rows, top_k, experts = {"uneven": (13, 3, 7), "one_expert": (21, 1, 5), "scattered": (6, 8, 32),
                            "one_row": (1, 2, 4)}[routing]
    gen = torch.Generator().manual_seed(seed)
    if routing == "uneven":
        popularity = torch.tensor([0.0, 4.0, 2.0, 1.0, 0.5, 0.0, 0.0])
        others = torch.multinomial(popularity.expand(rows, -1), top_k - 1, replacement=False, generator=gen)
        chosen = torch.cat([torch.zeros(rows, 1, dtype=torch.long), others], dim=1)
        expert_ids = chosen.gather(1, torch.argsort(torch.rand(rows, top_k, generator=gen), dim=1))
    elif routing == "one_expert":
        expert_ids = torch.full((rows, 1), 3, dtype=torch.long)
    else:
        expert_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    x = torch.randn(rows, HIDDEN, generator=gen)
    weights = torch.softmax(torch.randn(rows, top_k, generator=gen), dim=-1)
    gate_up = torch.randn(experts, 2 * WIDTH, HIDDEN, generator=gen) * HIDDEN ** -0.5
    down = torch.randn(experts, HIDDEN, WIDTH, generator=gen) * WIDTH ** -0.5
    expected = routed_experts(x.double(), expert_ids, weights.double(), gate_up.double(), down.double())
    return Case(x, expert_ids, weights, gate_up, down, expected)


ROUTINGS = ["uneven", "one_expert", "scattered", "one_row"]


def poisoned_call(args: tuple[torch.Tensor, ...], blocks: GroupedBlocks) -> torch.Tensor:
    """The grouped form writing into NaN-poisoned out, h and partials."""
    x, expert_ids, _, gate_up, down = args
    padded = max_blocks(expert_ids.numel(), gate_up.shape[0], blocks.block_m) * blocks.block_m
    nan = float("nan")
    out = torch.full(x.shape, nan, device=x.device)
    h = torch.full((padded, gate_up.shape[1] // 2), nan, dtype=down.dtype, device=x.device)
    partials = torch.full((expert_ids.numel(), x.shape[1]), nan, device=x.device)
    return moe_experts_grouped(*args, blocks=blocks, out=out, h=h, partials=partials)


def dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


# where the Triton launcher runs: CPU tensors under the interpreter (conftest.py sets it where no GPU is), CUDA
# (its torch twin is moe.py's moe_experts_torch, held to the reference in test_moe.py and compared with below)
TRITON_DEVICES = ((["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON else [])
                  + (["cuda"] if torch.cuda.is_available() else []))


# -- the alignment ----------------------------------------------------------------------------------

def test_alignment_worked_example():
    """Pairs 0..5 choose experts 2 0 | 2 1 | 0 2 (rows of k = 2), E = 4, block_m = 2: expert 0 takes pairs 1, 4;
    expert 1 pair 3 and one pad; expert 2 pairs 0, 2, 5 and one pad; expert 3 none. The bound: (6 + 4) // 2 = 5
    blocks, the last one unused."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    want = ExpertAlignment(torch.tensor([1, 4, 3, 6, 0, 2, 5, 6, 6, 6], dtype=torch.int32),
                           torch.tensor([0, 1, 2, 2, -1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    for align in (align_by_expert, align_by_expert_torch):
        got = align(ids, 4, 2)
        for name, a, b in zip(ExpertAlignment._fields, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{align.__name__}: {name} {a.tolist()} != {b.tolist()}"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("block_m", [1, 2, 16, 64])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_alignment_matches_its_twin(device, routing, block_m):
    """EXACT: the sync-free torch ops against the written-out twin (on CUDA: the device's sort and searchsorted)."""
    case = make_case(routing, seed=block_m)
    ids = case.expert_ids.to(device)
    num_experts = case.gate_up.shape[0]
    got, want = align_by_expert(ids, num_experts, block_m), align_by_expert_torch(ids, num_experts, block_m)
    for name, a, b in zip(ExpertAlignment._fields, got, want):
        assert torch.equal(a, b), f"{name} differs from the twin"
    num_pairs = ids.numel()
    real = want.sorted_pairs[want.sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "each pair exactly once"
    assert got.sorted_pairs.numel() == max_blocks(num_pairs, num_experts, block_m) * block_m


def test_alignment_bound_is_reached():
    """One pair on each of E experts at block_m = 4: every pair its own padded block, the bound met exactly."""
    ids = torch.arange(12).reshape(4, 3)
    got = align_by_expert(ids, 12, 4)
    assert int(got.num_blocks) == max_blocks(12, 12, 4) == 12 and bool((got.block_experts == torch.arange(12)).all())


# -- the grouped GEMM -------------------------------------------------------------------------------

@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_grouped_matches_reference_and_torch_form(device, report, routing):
    case = make_case(routing, seed=len(routing))
    for dtype in dtypes(device):
        args = case.inputs(device, dtype)
        for blocks in (TINY, GroupedBlocks()):
            got = poisoned_call(args, blocks)
            assert got.dtype == torch.float32 and got.shape == case.x.shape
            what = f"y/{str(dtype)[6:]}" + ("/tiny" if blocks is TINY else "")
            report.numeric(what, got, case.expected, NUMERIC_BOUND[dtype])
            if dtype == torch.float32:
                report.numeric(what + "/vs_torch", got, moe_experts_torch(*args), NUMERIC_BOUND[dtype])
            assert torch.equal(poisoned_call(args, blocks), got), "two calls differ"


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_grouped_out_dtype_and_no_pairs(device):
    args = make_case("uneven").inputs(device, torch.float32)
    full = moe_experts_grouped(*args, blocks=TINY)
    half = moe_experts_grouped(*args, blocks=TINY, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    assert bool(((half.float() - full).abs() <= 2.0 ** -10 * full.abs() + 2.0 ** -24).all())  # one fp16 rounding
    x, ids, weights, gate_up, down = args
    empty = moe_experts_grouped(x[:0], ids[:0], weights[:0], gate_up, down, blocks=TINY)
    assert empty.shape == (0, HIDDEN) and empty.dtype == torch.float32


@pytest.mark.parametrize("planted", ["gate_up_swapped", "block_expert_off_by_one"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_grouped_planted_bugs_are_caught(device, planted, monkeypatch):
    case = make_case("uneven", seed=7)
    x, expert_ids, weights, gate_up, down = case.inputs(device, torch.float32)
    if planted == "gate_up_swapped":
        gate_up = torch.cat([gate_up[:, WIDTH:], gate_up[:, :WIDTH]], dim=1)
    else:
        def misaligned(*args):
            got = align_by_expert(*args)
            experts = got.block_experts.clone()
            experts[0] = (experts[0] + 1) % gate_up.shape[0]  # the first block computed with its neighbour's weights
            return got._replace(block_experts=experts)

        monkeypatch.setattr(moe_grouped, "align_by_expert", misaligned)
    got = moe_experts_grouped(x, expert_ids, weights, gate_up, down, blocks=TINY).double().cpu()
    rms_rel = float((got - case.expected).pow(2).mean().sqrt() / case.expected.pow(2).mean().sqrt())
    assert rms_rel > 100 * NUMERIC_BOUND[torch.float32], f"the planted bug ({planted}) passes NUMERIC: {rms_rel:.1e}"


@pytest.mark.parametrize("field,value", [("block_m", 48), ("block_i", 8), ("block_c", 0), ("block_k", 96),
                                         ("num_warps", 3), ("num_stages", 0), ("sum_block_c", 12)])
def test_bad_blocks_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"GroupedBlocks.{field} = {value}"):
        GroupedBlocks(**{field: value})


@pytest.mark.parametrize("bad", ["h", "partials", "out", "x"])
def test_bad_buffers_name_the_argument(bad):
    x, expert_ids, weights, gate_up, down = make_case("uneven").inputs("cpu", torch.float32)
    kwargs = {}
    if bad == "x":
        x = x[:, :-1]
    else:
        kwargs[bad] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="gate_up" if bad == "x" else bad):
        moe_experts_grouped(x, expert_ids, weights, gate_up, down, blocks=TINY, **kwargs)


# -- the op's dispatch ------------------------------------------------------------------------------

def test_op_sends_more_than_max_triton_pairs_to_the_grouped_form(monkeypatch):
    """At the real bound: MAX_TRITON_PAIRS pairs take the per-pair kernels, one more the grouped GEMM (the forms
    replaced by recorders: the dispatch alone is under test here)."""
    calls = []
    monkeypatch.setattr(moe, "moe_experts_triton", lambda *a, **k: calls.append("per_pair"))
    monkeypatch.setattr(moe_grouped, "moe_experts_grouped", lambda *a, **k: calls.append("grouped"))
    bound = moe.MAX_TRITON_PAIRS
    for pairs in (bound, bound + 1):
        ids = torch.zeros(pairs, 1, dtype=torch.long)
        moe_experts_gpu(torch.zeros(pairs, 4), ids, ids.float(), torch.zeros(1, 2, 4), torch.zeros(1, 4, 1))
    assert calls == ["per_pair", "grouped"]
    assert moe_experts.gpu_forms[0].fn is moe_experts_gpu and len(moe_experts.gpu_forms) == 1


@pytest.mark.skipif(not HAS_TRITON, reason="the GPU forms need triton")
@pytest.mark.skipif(not INTERPRETED, reason="runs the GPU forms on CPU tensors in Triton's interpreter (on a CUDA machine the kernels compile for the device)")
def test_op_runs_the_grouped_form_past_the_bound(monkeypatch):
    """Under forced_gpu (the interpreter), with the bound lowered to 16 pairs: a 39-pair call goes through the
    grouped GEMM and returns its bits; a 3-pair call keeps the per-pair kernels."""
    monkeypatch.setattr(moe, "MAX_TRITON_PAIRS", 16)
    seen = []
    real = moe_grouped.moe_experts_grouped
    monkeypatch.setattr(moe_grouped, "moe_experts_grouped", lambda *a, **k: seen.append(a[1].numel()) or real(*a, **k))
    case = make_case("uneven")
    args = case.inputs("cpu", torch.float32)
    with forced_gpu([moe_experts]):
        got = moe_experts(*args)
        small = moe_experts(*(a[:1] if a.dim() == 2 else a for a in args))
    assert seen == [39]
    assert torch.equal(got, real(*args))
    assert torch.equal(small, moe.moe_experts_triton(*(a[:1] if a.dim() == 2 else a for a in args)))


def test_op_is_capturable_on_cuda_only():
    assert moe_experts.capturable("cuda") == HAS_TRITON
    assert not moe_experts.capturable("cpu")


# -- CUDA ---------------------------------------------------------------------------------------------

def _graph_replay_equals_eager(args: tuple[torch.Tensor, ...], blocks: GroupedBlocks | None = None) -> torch.Tensor:
    eager = moe_experts_grouped(*args, blocks=blocks)  # compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts_grouped(*args, blocks=blocks)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_grouped(*args, blocks=blocks)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), "the graph replay differs from the eager call"
    return eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_cuda_graph_replay_is_exact(routing):
    case = make_case(routing)
    for dtype in (torch.float32, torch.bfloat16):
        _graph_replay_equals_eager(case.inputs("cuda", dtype), TINY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the released shapes run in the GPU lane")
@pytest.mark.parametrize("rows", [300, 2048])
def test_grouped_at_released_prefill_shapes(report, rows):
    """Qwen3.5-35B-A3B's experts (C = 2048, I = 512, E = 256, k = 8) in bf16 at prefill chunk sizes (past
    MAX_TRITON_PAIRS), routed by a softmax over random logits: NUMERIC against the torch form in fp32, exact under
    graph replay, and the op dispatches here."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, width, experts, top_k = 2048, 512, 256, 8
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(rows, experts, device="cuda", generator=gen) * 2, dim=-1)
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    gate_up = (torch.randn(experts, 2 * width, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    down = (torch.randn(experts, hidden, width, device="cuda", generator=gen) * width ** -0.5).bfloat16()
    args = (x, expert_ids, weights, gate_up, down)
    assert expert_ids.numel() > moe.MAX_TRITON_PAIRS
    got = _graph_replay_equals_eager(args)
    assert torch.equal(moe_experts(*args), got)
    expected = moe_experts_torch(x.float(), expert_ids, weights, gate_up.float(), down.float())
    report.numeric("y/bfloat16", got, expected, NUMERIC_BOUND[torch.bfloat16])
