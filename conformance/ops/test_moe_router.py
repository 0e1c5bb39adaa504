"""fast/kernels/moe/moe_router.py and its torch twin vs reference/model/moe.route computed in float64:
odd sizes (C = 48; E in {7, 17, 64}; k in {1, 3, 8}; N in {1, 5, 33}), fp32 inputs (the CPU
interpreter's bf16 arithmetic is not the GPU's), the default blocks and small ones (E, N and C
tiles that do not divide the sizes), and C split across programs (2, 3 and 4 ranges, one cut at
C; N in {1, 3, 8, 17}, with and without the shared gate; a split left empty is refused). Ids EXACT
(the cases are checked to have no near ties, so the comparison is meaningful), weights NUMERIC; the
partial-logits scratch poisoned with NaN; two runs bitwise equal. Exact ties, planted by duplicate
router rows, must follow the stated rule (the lowest expert id first) in the kernel and in the torch
twin alike. Planted bugs (the opposite tie rule, weights not renormalised, one id off by one) must
fail the checks. On CUDA, a CUDA-graph replay equals the eager call bit for bit, at the released
model's shapes too (16 and 128 rows there take the split defaults; 4096, a prefill chunk, the op's GPU form too:
the op picks it at every row count)."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON, INTERPRETED
from dflash2.fast.kernels.moe.moe_router import RouterBlocks, default_blocks, route_torch, route_triton
from dflash2.fast.kernels.moe.moe_router import route
from dflash2.reference.model.moe import route as reference_route

HIDDEN = 48
SMALL = RouterBlocks(block_n=4, block_e=4, block_c=32)  # N = 5, E = 7/17, C = 48: partial tiles everywhere
SPLITS = {  # C = 48 across programs; E = 17 (18 with the shared gate): partial E tiles in all
    "2": RouterBlocks(block_n=4, block_e=4, block_c=16, num_splits=2),  # ranges [0, 32), [32, 48): cut at C
    "3": RouterBlocks(block_n=2, block_e=8, block_c=16, num_splits=3),  # one step a range
    "4": RouterBlocks(block_n=8, block_e=2, block_c=4, num_splits=4),  # three steps a range
}


def make_inputs(rows: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=gen)
    w_router = torch.randn(experts, HIDDEN, generator=gen) * 2 * HIDDEN ** -0.5  # logits ~ N(0, 4)
    return x, w_router


def run(impl: str, x: torch.Tensor, w_router: torch.Tensor, top_k: int, blocks: RouterBlocks | None = None,
        shared_gate: bool = False):
    """The implementation under test; the Triton launcher writes its partial logits into a NaN-poisoned
    scratch ``[num_splits, N, E (+ 1)]``."""
    if impl == "torch":
        return route_torch(x, w_router, top_k, shared_gate=shared_gate)
    splits = (default_blocks(x.shape[0], w_router.shape[0], x.shape[1]) if blocks is None else blocks).num_splits
    logits = torch.full((splits, x.shape[0], w_router.shape[0]), float("nan"), device=x.device)
    return route_triton(x, w_router, top_k, shared_gate=shared_gate, blocks=blocks, logits=logits)


def min_gap(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> float:
    """The smallest relative gap between neighbours of the float64 order among the first k + 1 probs."""
    probs = torch.softmax(x.double() @ w_router.double().T, dim=-1).sort(dim=-1, descending=True).values
    head = probs[:, :top_k + 1]
    return float(((head[:, :-1] - head[:, 1:]) / head[:, :-1]).min()) if head.shape[1] > 1 else 1.0


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("experts,top_k", [(7, 1), (7, 3), (17, 3), (17, 8), (64, 1), (64, 8)])
def test_route_matches_reference(impl_device, report, rows, experts, top_k):
    impl, device = impl_device
    x, w_router = make_inputs(rows, experts, seed=100 * experts + rows)
    assert min_gap(x, w_router, top_k) > 1e-5, "the case has a near tie: EXACT ids would test rounding"
    ref_ids, ref_weights = reference_route(x.double(), w_router.double(), top_k)
    for blocks in [None, SMALL] if impl == "triton" else [None]:
        ids, weights = run(impl, x.to(device), w_router.to(device), top_k, blocks)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (rows, top_k)
        assert torch.equal(ids.cpu(), ref_ids), "expert ids differ from the reference (EXACT)"
        report.numeric("weights/float32" + ("/small" if blocks else ""), weights, ref_weights,
                       NUMERIC_BOUND[torch.float32])
        again = run(impl, x.to(device), w_router.to(device), top_k, blocks)
        assert torch.equal(again[0], ids) and torch.equal(again[1], weights), "two runs differ"


def tied_case(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E = 17 router rows with exact duplicates: experts 2, 9, 13 are one row, made every token's
    favourite (a shared direction in x), and experts 5, 11 another, somewhere in the order. Returns
    x, w_router and the tie rule's expected order (float64 probabilities, equal ones by ascending id).
    Not expert 16: CPU BLAS computes the 17th of 17 output columns in its tail code, one rounding
    apart from a duplicate elsewhere, so the torch twin would see no tie there."""
    gen = torch.Generator().manual_seed(rows)
    direction = torch.randn(HIDDEN, generator=gen)
    x = direction + 0.3 * torch.randn(rows, HIDDEN, generator=gen)
    w_router = torch.randn(17, HIDDEN, generator=gen) * HIDDEN ** -0.5
    w_router[[2, 9, 13]] = 6 * direction / direction.norm() ** 2
    w_router[11] = w_router[5]
    canonical = torch.arange(17)
    canonical[[9, 13]] = 2
    canonical[11] = 5
    probs = torch.softmax(x.double() @ w_router.double().T, dim=-1)[:, canonical]  # duplicates bitwise equal
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    logits = x @ w_router.T  # the torch twin's, on CPU: the planted ties must be exact there too
    assert torch.equal(logits[:, [2, 9, 13, 5, 11]], logits[:, [2, 2, 2, 5, 5]])
    return x, w_router, order


def reversed_tie_rule(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> torch.Tensor:
    """A planted bug: ties by the highest id (the torch twin on the experts in reverse order)."""
    return w_router.shape[0] - 1 - route_torch(x, w_router.flip(0), top_k)[0]


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
@pytest.mark.parametrize("rows", [1, 5])
def test_route_ties_go_to_the_lowest_id(impl_device, rows, top_k):
    impl, device = impl_device
    x, w_router, order = tied_case(rows)
    assert torch.equal(order[:, :3], torch.tensor([[2, 9, 13]] * rows)), "the tied favourites are not on top"
    ids, _ = run(impl, x.to(device), w_router.to(device), top_k, SMALL if impl == "triton" else None)
    assert torch.equal(ids.cpu(), order[:, :top_k]), "ties not broken by the lowest id"
    assert torch.equal(ids.cpu(), route_torch(x, w_router, top_k)[0]), "kernel and torch twin differ on ties"
    if top_k <= 3:  # the planted opposite rule picks 13 before 9 before 2
        assert not torch.equal(reversed_tie_rule(x, w_router, top_k), ids.cpu()), "the tie check has no teeth"


@pytest.mark.parametrize("planted", ["not_renormalised", "id_off_by_one"])
def test_route_planted_bugs_are_caught(planted):
    x, w_router = make_inputs(5, 17, seed=3)
    ref_ids, ref_weights = reference_route(x.double(), w_router.double(), 3)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs CPU tensors
    ids, weights = (t.cpu() for t in route_triton(x.to(device), w_router.to(device), 3))
    if planted == "not_renormalised":
        weights = torch.softmax(x @ w_router.T, dim=-1).gather(1, ids)
        rel = float((weights.double() - ref_weights).pow(2).mean().sqrt() / ref_weights.pow(2).mean().sqrt())
        assert rel > 100 * NUMERIC_BOUND[torch.float32], f"the planted bug passes NUMERIC: {rel:.1e}"
    else:
        ids = ids.clone()
        ids[2, 1] = (ids[2, 1] + 1) % 17
        assert not torch.equal(ids, ref_ids), "the planted bug passes EXACT"


def test_route_default_dispatch_on_cpu():
    """The model's router keeps the torch form on CPU (the engine's CPU path), bit for bit."""
    x, w_router = make_inputs(5, 17, seed=4)
    for got, want in zip(route(x, w_router, 3), route_torch(x, w_router, 3)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not HAS_TRITON, reason="the GPU form needs triton")
@pytest.mark.skipif(not INTERPRETED, reason="runs the GPU forms on CPU tensors in Triton's interpreter (on a CUDA machine the kernels compile for the device)")
def test_route_takes_a_prefill_chunk_on_the_gpu_form(report):
    """The op's GPU form takes every row count: a prefill chunk routes by the kernels, as decode and verify steps
    do (under forced_gpu on the CPU: the interpreter). A 4096-row chunk picks the kernels; 100 rows (seven
    blocks of 16, the last partial), E = 17, k = 3 run through the op: ids EXACT and weights NUMERIC against the
    reference, the op's result the launcher's bit for bit."""
    x, w_router = make_inputs(100, 17, seed=600)
    assert min_gap(x, w_router, 3) > 1e-5, "the case has a near tie: EXACT ids would test rounding"
    with forced_gpu([route]):
        assert route.pick(x.new_zeros(4096, HIDDEN), w_router, 3) is route_triton
        ids, weights = route(x, w_router, 3)
    ref_ids, ref_weights = reference_route(x.double(), w_router.double(), 3)
    assert torch.equal(ids, ref_ids), "expert ids differ from the reference (EXACT)"
    report.numeric("weights/float32", weights, ref_weights, NUMERIC_BOUND[torch.float32])
    again = route_triton(x, w_router, 3)
    assert torch.equal(again[0], ids) and torch.equal(again[1], weights)


def test_route_no_rows(impl_device):
    impl, device = impl_device
    x, w_router = make_inputs(1, 7, seed=5)
    ids, weights = pick(impl, route_torch, route_triton)(x[:0].to(device), w_router.to(device), 3)
    assert ids.shape == weights.shape == (0, 3) and ids.dtype == torch.int64 and weights.dtype == torch.float32


@pytest.mark.parametrize("bad", ["x", "w_router", "w_router_dtype", "top_k", "top_k_type", "logits"])
def test_route_bad_input_names_the_argument(bad):
    x, w_router = make_inputs(2, 7, seed=6)
    top_k, kwargs = 3, {}
    if bad == "x":
        x = x[None]
    elif bad == "w_router":
        w_router = w_router[:, :-1]
    elif bad == "w_router_dtype":
        w_router = w_router.double()
    elif bad == "top_k":
        top_k = 8
    elif bad == "top_k_type":
        top_k = 3.0
    else:
        kwargs["logits"] = torch.zeros(2, 6)
    with pytest.raises(ValueError, match=bad.split("_dtype")[0].split("_type")[0]):
        route_triton(x, w_router, top_k, **kwargs)


@pytest.mark.parametrize("shared_gate", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("splits", sorted(SPLITS))
def test_route_split_c_matches_reference(impl_device, report, splits, rows, shared_gate):
    """C split across programs, the partials summed in kernel 2: ids EXACT against the float64 reference
    and the torch twin, weights (and the shared gate's) NUMERIC; two runs bitwise equal."""
    impl, device = impl_device
    if impl == "torch":
        pytest.skip("the split is the Triton kernel's")
    experts, top_k, blocks = 17, 3, SPLITS[splits]
    x, w_router = make_inputs(rows, experts + int(shared_gate), seed=900 + rows)
    routed = w_router[:experts]
    assert min_gap(x, routed, top_k) > 1e-5, "the case has a near tie: EXACT ids would test rounding"
    ref_ids, ref_weights = reference_route(x.double(), routed.double(), top_k)
    ids, weights = run(impl, x.to(device), w_router.to(device), top_k, blocks, shared_gate)
    assert ids.shape == weights.shape == (rows, top_k + int(shared_gate))
    twin_ids = route_torch(x, w_router, top_k, shared_gate=shared_gate)[0]
    assert torch.equal(ids.cpu(), twin_ids), "expert ids differ from the torch twin (EXACT)"
    assert torch.equal(ids[:, :top_k].cpu(), ref_ids), "expert ids differ from the reference (EXACT)"
    report.numeric(f"weights/split{splits}", weights[:, :top_k], ref_weights, NUMERIC_BOUND[torch.float32])
    if shared_gate:
        ref_gate = torch.sigmoid(x.double() @ w_router[experts].double())  # [N]
        report.numeric(f"gate/split{splits}", weights[:, top_k], ref_gate, NUMERIC_BOUND[torch.float32])
    again = run(impl, x.to(device), w_router.to(device), top_k, blocks, shared_gate)
    assert torch.equal(again[0], ids) and torch.equal(again[1], weights), "two runs differ"


def test_route_default_blocks_split_c_past_8_rows():
    """Up to 8 rows C is one range; past 8, two ranges (the H200 sweep's choices), one where C is one step."""
    for rows in (1, 2, 8):
        assert default_blocks(rows, 257, 2048).num_splits == 1
    for rows in (9, 32, 128):
        assert default_blocks(rows, 257, 2048) == RouterBlocks(16, 8, 128, num_warps=8, num_splits=2)
    assert default_blocks(33, 17, HIDDEN).num_splits == 1  # one step of C = 48 in all


@pytest.mark.parametrize("bad", ["empty_split", "zero_splits", "logits_unsplit"])
def test_route_bad_split_is_refused(bad):
    """A split whose C range would be empty, num_splits < 1, and a scratch without the split axis."""
    x, w_router = make_inputs(2, 7, seed=6)
    kwargs = {"blocks": RouterBlocks(4, 4, 8, num_splits=4)}  # C = 48 in 6 steps: 3 ranges of 2, the 4th empty
    if bad == "zero_splits":
        kwargs["blocks"] = RouterBlocks(4, 4, 8, num_splits=0)
    elif bad == "logits_unsplit":
        kwargs = {"blocks": SPLITS["2"], "logits": torch.zeros(2, 7)}
    with pytest.raises(ValueError, match="logits" if bad == "logits_unsplit" else "num_splits"):
        route_triton(x, w_router, 3, **kwargs)


def _graph_replay_equals_eager(x: torch.Tensor, w_router: torch.Tensor, top_k: int):
    eager = route_triton(x, w_router, top_k)  # compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        route_triton(x, w_router, top_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_triton(x, w_router, top_k)
    for _ in range(2):
        captured[0].fill_(-1)
        captured[1].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]), "replay differs"
    return eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the released shapes run in the GPU lane")
@pytest.mark.parametrize("rows", [1, 16, 128, 4096])
def test_route_at_released_shapes(report, rows):
    """Qwen3.5-35B-A3B's router (C = 2048, E = 256, k = 8), bf16 x: ids EXACT and weights NUMERIC
    (fp32) against the torch twin, exact under graph replay, and the model's dispatch sends it here."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    w_router = torch.randn(256, 2048, device="cuda", generator=gen) * 2 * 2048 ** -0.5
    ids, weights = _graph_replay_equals_eager(x, w_router, 8)
    want_ids, want_weights = route_torch(x, w_router, 8)
    assert torch.equal(ids, want_ids)
    report.numeric("weights/fp32", weights, want_weights, NUMERIC_BOUND[torch.float32])
    assert all(torch.equal(a, b) for a, b in zip(route(x, w_router, 8), (ids, weights)))


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_route_with_the_shared_gate_appends_it_as_expert_e(impl_device, report, rows):
    """``shared_gate=True``: row E of w_router is the shared expert's gate vector; the routed choices are
    the plain router's (EXACT ids, NUMERIC weights) and column k is id E with weight sigmoid(w_sg . x)."""
    impl, device = impl_device
    experts, top_k = 17, 3
    x, w_router = make_inputs(rows, experts + 1, seed=700 + rows)
    routed = w_router[:experts]
    assert min_gap(x, routed, top_k) > 1e-5, "the case has a near tie: EXACT ids would test rounding"
    ref_ids, ref_weights = reference_route(x.double(), routed.double(), top_k)
    ref_gate = torch.sigmoid(x.double() @ w_router[experts].double())  # [N]
    if impl == "torch":
        ids, weights = route_torch(x.to(device), w_router.to(device), top_k, shared_gate=True)
    else:
        logits = torch.full((rows, experts + 1), float("nan"), device=device)
        ids, weights = route_triton(x.to(device), w_router.to(device), top_k, shared_gate=True, logits=logits)
    assert ids.shape == weights.shape == (rows, top_k + 1)
    assert torch.equal(ids[:, :top_k].cpu(), ref_ids), "routed ids differ from the reference (EXACT)"
    assert torch.equal(ids[:, top_k].cpu(), torch.full((rows,), experts)), "the shared expert is not id E"
    report.numeric("weights/shared_gate", weights[:, :top_k], ref_weights, NUMERIC_BOUND[torch.float32])
    report.numeric("gate/shared_gate", weights[:, top_k], ref_gate, NUMERIC_BOUND[torch.float32])


@pytest.mark.parametrize("shared_gate", [False, True])
@pytest.mark.parametrize("rows", [5, 33])
def test_route_with_gemm_logits_matches_reference(impl_device, report, rows, shared_gate):
    """``gemm=True`` (the prefill chunks' form): the logits by one fp32 GEMM into the NaN-poisoned scratch, then
    kernel 2: ids EXACT and weights NUMERIC against the reference, the shared gate's column as with kernel 1."""
    impl, device = impl_device
    if impl != "triton":
        pytest.skip("the GEMM form is the Triton launcher's")
    experts, top_k = 17, 3
    x, w_router = make_inputs(rows, experts + int(shared_gate), seed=900 + rows)
    routed = w_router[:experts]
    assert min_gap(x, routed, top_k) > 1e-5, "the case has a near tie: EXACT ids would test rounding"
    ref_ids, ref_weights = reference_route(x.double(), routed.double(), top_k)
    logits = torch.full((rows, w_router.shape[0]), float("nan"), device=device)
    ids, weights = route_triton(x.to(device), w_router.to(device), top_k, shared_gate=shared_gate, logits=logits,
                                gemm=True)
    assert torch.equal(ids[:, :top_k].cpu(), ref_ids), "expert ids differ from the reference (EXACT)"
    report.numeric("weights/gemm_logits", weights[:, :top_k], ref_weights, NUMERIC_BOUND[torch.float32])
    if shared_gate:
        ref_gate = torch.sigmoid(x.double() @ w_router[experts].double())
        report.numeric("gate/gemm_logits", weights[:, top_k], ref_gate, NUMERIC_BOUND[torch.float32])


def test_route_takes_the_gemm_past_gemm_rows(impl_device):
    """The default form: kernel 1 up to GEMM_ROWS rows, the GEMM past them (bitwise what each form gives)."""
    from dflash2.fast.kernels.moe.moe_router import GEMM_ROWS

    impl, device = impl_device
    if impl != "triton":
        pytest.skip("the GEMM form is the Triton launcher's")
    x, w_router = make_inputs(GEMM_ROWS + 1, 17, seed=950)
    x, w_router = x.to(device), w_router.to(device)
    for rows, gemm in ((GEMM_ROWS, False), (GEMM_ROWS + 1, True)):
        default = route_triton(x[:rows], w_router, 3)
        chosen = route_triton(x[:rows], w_router, 3, gemm=gemm)
        other = route_triton(x[:rows], w_router, 3, gemm=not gemm)
        # the two forms sum in different orders: their weights differ in some last bit, so the check can tell them
        assert not torch.equal(chosen[1], other[1]), "the forms agree bit for bit: the check would prove nothing"
        assert all(torch.equal(a, b) for a, b in zip(default, chosen)), f"{rows} rows: expected gemm={gemm}"
