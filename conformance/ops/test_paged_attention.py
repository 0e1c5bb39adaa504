"""fast/kernels/attention/paged_attention.py (and the model's torch form ``paged_attention_torch``) vs
reference/model/attention.causal_attention, one sequence at a time: decode (Tq = 1) and verify
(Tq = 5, ragged rows per sequence) steps of three sequences whose contexts end mid-page, on a page
boundary and after a few keys, plus a padding sequence (state slot -1) that must come out zero even
with a context length and a real page in its table. Pages are scattered over the cache in no order;
every slot outside the contexts (the ends of pages, unused pages, the trash row) is NaN. GQA with
H = 6, Hkv = 2, head dims 16, 32 and 20 (padded in the kernel), page sizes 8 and 16 (and 5).
The split kernel runs with one split (written directly) and with several splits of one or three chunks
(merged). Prefill chunks (more than 16 rows per sequence) take the flash-attention kernel: chunks that
start at 0 (a context of only their own rows) and that continue after a context, of row counts that are
not multiples of the block, several sequences of different lengths in one call (programs past the shorter
ones' rows), GQA groups 1, 2, 3 and 8 with every head-stacking the kernel allows, head dims 16, 20, 64
and 256. NUMERIC (fp32 1e-5, fp16 5e-3; bf16 2e-2 on CUDA); the padding rows EXACT zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.attention import paged_attention as kernel_module
from dflash2.fast.kernels.attention.paged_attention import (paged_attention_decode, paged_attention_prefill,
                                                              paged_attention_triton, prefill_plan)
from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.attention.paged_attention import paged_attention, paged_attention_torch
from dflash2.fast.model.batch import PAD_SLOT, ForwardBatch
from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.step import StepMeta
from dflash2.reference.model.attention import causal_attention
from dflash2.reference.tiny.target import tiny_target_config

HEADS, KV_HEADS = 6, 2
SLOTS = (2, 0, 3)  # GDN slots of the three real sequences; the padding sequence has PAD_SLOT


@dataclass
class Case:
    q: torch.Tensor  # [N, H, D]
    key_cache: torch.Tensor  # [S, Hkv, D], S = num_pages * page_size + 1 (the trash row); NaN off-context
    value_cache: torch.Tensor
    batch: ForwardBatch
    pools: CachePools  # only for StepMeta.build (page size, trash row, rope); its own tensors are unused
    expected: torch.Tensor  # [N, H, D] from the reference (zeros on the padding rows)
    padding_rows: torch.Tensor  # [N] bool


def make_case(contexts: list[int], rows: list[int], dim: int, page_size: int, seed: int, pad_rows: int | None = None,
              spare_pages: int = 1, heads: int = HEADS, kv_heads: int = KV_HEADS) -> Case:
    """Sequence b has ``contexts[b]`` keys after this step, the last ``rows[b]`` of them its query rows;
    a padding sequence of ``pad_rows`` rows (default: up to 2, no more than the others) comes last."""
    pad_rows = min(2, max(rows)) if pad_rows is None else pad_rows
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // page_size) for c in contexts]
    num_pages = sum(pages_per_seq) + 3  # some pages belong to nobody
    width = max(pages_per_seq) + spare_pages  # -1 past each sequence's pages
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in pages_per_seq:
        tables.append(order[used:used + n])
        used += n
    num_slots = num_pages * page_size
    key_cache = torch.full((num_slots + 1, kv_heads, dim), float("nan"))
    value_cache = key_cache.clone()

    num_rows = sum(rows) + pad_rows
    q = torch.randn(num_rows, heads, dim, generator=gen)
    expected = torch.zeros(num_rows, heads, dim)
    positions, kv_slots, first = [], [], 0
    for b, (context, n) in enumerate(zip(contexts, rows)):
        t = torch.arange(context)
        slots = torch.tensor(tables[b])[t // page_size] * page_size + t % page_size
        keys, values = (torch.randn(context, kv_heads, dim, generator=gen) for _ in range(2))
        key_cache[slots], value_cache[slots] = keys, values
        pos = torch.arange(context - n, context)
        expected[first:first + n] = causal_attention(q[first:first + n], keys, values, pos)
        positions += pos.tolist()
        kv_slots += slots[context - n:].tolist()
        first += n
    # a padding sequence as a CUDA-graph bucket may leave it: stale context length and a real page
    positions += list(range(pad_rows))
    kv_slots += [PAD_SLOT] * pad_rows
    padding_tables = [tables[0][:1]] if pad_rows else []
    cu = torch.tensor([0] + rows + ([pad_rows] if pad_rows else [])).cumsum(0)
    state_slots = list(SLOTS[:len(contexts)]) + ([PAD_SLOT] if pad_rows else [])
    longs = dict(dtype=torch.long)
    batch = ForwardBatch(
        token_ids=torch.zeros(num_rows, **longs), positions=torch.tensor(positions, **longs),
        cu_seqlens=cu.to(torch.int32), state_slots=torch.tensor(state_slots, **longs),
        kv_slot_mapping=torch.tensor(kv_slots, **longs),
        block_tables=torch.tensor([p + [-1] * (width - len(p)) for p in tables + padding_tables], dtype=torch.int32),
        context_lens=torch.tensor(contexts + ([min(3, page_size)] if pad_rows else []), **longs),
        is_verify=max(rows) > 1, logits_rows=torch.arange(num_rows), max_query_len=max(rows + [pad_rows]))
    pools = CachePools(tiny_target_config("tiny-dense"), num_pages, page_size, num_slots=4,
                       max_verify_rows=max(rows + [pad_rows]), dtype=torch.float32, device="cpu")
    padding_rows = torch.zeros(num_rows, dtype=torch.bool)
    padding_rows[sum(rows):] = True
    return Case(q, key_cache, value_cache, batch, pools, expected, padding_rows)


def batch_to(batch: ForwardBatch, device: str) -> ForwardBatch:
    return replace(batch, **{f: getattr(batch, f).to(device) for f in
                             ("token_ids", "positions", "cu_seqlens", "state_slots", "kv_slot_mapping",
                              "block_tables", "context_lens", "logits_rows")})


def run(fn, case: Case, device: str, dtype: torch.dtype, meta_edit=None, **kwargs) -> torch.Tensor:
    pools = case.pools if device == "cpu" else CachePools(
        case.pools.cfg, case.pools.num_pages, case.pools.page_size, 4, case.pools.max_verify_rows, torch.float32,
        device)
    meta = StepMeta.build(batch_to(case.batch, device), pools)
    if meta_edit is not None:
        meta = meta_edit(meta)
    to = dict(device=device, dtype=dtype)
    got = fn(case.q.to(**to), case.key_cache.to(**to), case.value_cache.to(**to), meta, **kwargs)
    assert got.dtype == dtype and got.shape == case.q.shape
    return got.float().cpu()


def check(fn, case: Case, device: str, dtype: torch.dtype, report, meta_edit=None, **kwargs) -> None:
    got = run(fn, case, device, dtype, meta_edit, **kwargs)
    real = ~case.padding_rows
    report.numeric(f"attention/{str(dtype)[6:]}", got[real], case.expected[real], NUMERIC_BOUND[dtype])
    assert torch.equal(got[case.padding_rows], torch.zeros_like(got[case.padding_rows])), "padding rows not zero"


SHAPES = [  # contexts, rows per sequence, D, page_size
    ([37, 16, 3], [1, 1, 1], 16, 8),  # decode: mid-page, a page boundary, a short context
    ([45, 32, 7], [5, 3, 1], 32, 16),  # verify with ragged rows (k_b = 4, 2, 0)
    ([29, 64, 5], [5, 5, 5], 16, 16),
    ([50, 17, 9], [4, 2, 5], 20, 8),  # D padded to 32 in the kernel
    ([23, 10, 2], [3, 1, 2], 16, 5),  # a page size the engine does not use (the layer tests use 3)
    ([300, 130, 20], [2, 1, 2], 16, 16),  # > 16 splits of 16: the merge runs over two chunks of splits
]
TUNINGS = [{}, {"split_len": 16, "block_n": 16}, {"split_len": 48, "block_n": 16}]  # one split; many; 3 chunks each


def shape_id(shape) -> str:
    contexts, rows, dim, page_size = shape
    return f"ctx{'-'.join(map(str, contexts))}-Tq{max(rows)}-D{dim}-ps{page_size}"


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_attention_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    contexts, rows, dim, page_size = shape
    case = make_case(contexts, rows, dim, page_size, seed=sum(contexts) + dim)
    fn = pick(impl, paged_attention_torch, paged_attention_triton)
    # bf16 only on CUDA: Triton 3.6's interpreter multiplies bf16 tiles wrongly (tl.dot), fp16 exercises that path
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else []):
        for tuning in TUNINGS if impl == "triton" else [{}]:
            check(fn, case, device, dtype, report, **tuning)
    if impl == "triton":  # the merge reading its partials in several tiles (it takes 64 splits at a time)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel_module, "MERGE_SPLITS", 2)
            check(fn, case, device, torch.float32, report, split_len=16, block_n=16)


PREFILL_SHAPES = [  # contexts, rows per sequence, D, page_size, (H, Hkv), the prefill kernel's tile overrides
    # a chunk from 0 (its context is its rows), one after 14 keys, one after 37; G = 3: one head per tile
    ([40, 23, 57], [40, 9, 20], 16, 8, (6, 2), [{}, {"block_m": 16, "block_n": 16}, {"block_m": 32, "block_n": 32}]),
    # G = 8 in 16-row tiles: 8 heads x 2 rows, 4 heads x 4 rows, 1 head x 16 rows
    ([50, 33], [19, 33], 64, 16, (8, 1), [{"block_m": 16, "block_n": 16},
                                          {"block_m": 16, "block_n": 16, "heads_per_program": 4},
                                          {"block_m": 16, "block_n": 32, "heads_per_program": 1}]),
    # G = 2, D padded to 32, a page size the engine does not use
    ([31, 26], [24, 26], 20, 5, (4, 2), [{"block_m": 16, "block_n": 16},
                                         {"block_m": 32, "block_n": 16, "heads_per_program": 1}]),
    ([45, 18], [26, 18], 256, 16, (2, 2), [{"block_m": 16, "block_n": 16}]),  # G = 1, D = 256
    ([29, 64, 5], [5, 5, 5], 16, 16, (6, 2), [{"block_m": 16, "block_n": 16}]),  # a verify step: any step fits
]


def prefill_kernel(q, key_cache, value_cache, meta, **tiles):
    """The prefill kernel on a step, whatever its rows (the dispatch sends only long ones there)."""
    return paged_attention_prefill(q, key_cache, value_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens,
                                   meta.positions, max_query_len=meta.max_query_len, page_size=meta.page_size, **tiles)


def prefill_id(shape) -> str:
    contexts, rows, dim, page_size, (heads, kv_heads), _ = shape
    return f"ctx{'-'.join(map(str, contexts))}-Tq{'-'.join(map(str, rows))}-D{dim}-ps{page_size}-G{heads // kv_heads}"


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=prefill_id)
def test_paged_attention_prefill_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    contexts, rows, dim, page_size, (heads, kv_heads), tilings = shape
    case = make_case(contexts, rows, dim, page_size, seed=sum(contexts) + dim, heads=heads, kv_heads=kv_heads)
    fn = pick(impl, paged_attention_torch, prefill_kernel)
    dtypes = [torch.float32] + ([torch.float16] if dim <= 64 else []) + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        for tiles in tilings if impl == "triton" else [{}]:
            check(fn, case, device, dtype, report, **tiles)


@pytest.mark.parametrize("heads,kv_heads,dim,dtype,block_m,block_n,heads_per_program", [
    (16, 2, 256, torch.bfloat16, 128, 32, 8),  # the 35B-A3B
    (24, 4, 256, torch.bfloat16, 128, 32, 2),  # the 27B
    (16, 2, 256, torch.float32, 64, 16, 8),  # fp32 (the CUDA conformance lane) at D = 256
    (32, 8, 128, torch.bfloat16, 128, 64, 4),
    (6, 2, 20, torch.float32, 64, 64, 1),  # 12,288 rows x heads: 96 programs of 128 rows, so 64
])
def test_prefill_plan_fits_shared_memory(monkeypatch, heads, kv_heads, dim, dtype, block_m, block_n,
                                         heads_per_program):
    """A 2,048-row chunk on 132 SMs: 128-row tiles unless Q's would exceed 64 KB; K/V tiles as long as fit
    (at most 64 keys) beside Q in PREFILL_SMEM with two stages; as many heads per tile as divide G in powers
    of two."""
    monkeypatch.setattr(kernel_module, "_sm_count", lambda device: 132)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    plan = prefill_plan(1, heads, kv_heads, dim, 2048, itemsize, torch.device("cpu"))
    assert (plan.block_m, plan.block_n, plan.heads_per_program) == (block_m, block_n, heads_per_program)
    staged = (plan.block_m + 2 * plan.num_stages * plan.block_n) * plan.d_pad * itemsize
    assert staged <= kernel_module._prefill_smem(torch.device("cpu"))
    # a 512-row chunk of 16 heads would make 64 programs of 128 rows: 64-row tiles instead
    assert prefill_plan(1, 16, 2, 256, 512, 2, torch.device("cpu")).block_m == 64


@pytest.mark.parametrize("heads,kv_heads", [(16, 2), (24, 4)])  # the 35B-A3B, the 27B
def test_prefill_plan_takes_64_key_tiles_where_the_device_has_an_h100s_shared_memory(monkeypatch, heads, kv_heads):
    """With 227 KB a block (H100, H200) less the margin, a 2,048-row bf16 chunk at D = 256 gets 128 x 64 tiles in
    two stages, the sweep's fastest for both shapes; with PREFILL_SMEM (160 KB), 128 x 32."""
    monkeypatch.setattr(kernel_module, "_sm_count", lambda device: 132)
    monkeypatch.setattr(kernel_module, "_prefill_smem", lambda device: 227 * 1024 - kernel_module.SMEM_MARGIN)
    plan = prefill_plan(1, heads, kv_heads, 256, 2048, 2, torch.device("cpu"))
    assert (plan.block_m, plan.block_n, plan.num_stages, plan.num_warps) == (128, 64, 2, 8)
    # fp32 (the conformance lane) keeps the 160 KB budget the sweep did not widen: 64 x 16 as before
    assert prefill_plan(1, heads, kv_heads, 256, 2048, 4, torch.device("cpu")).block_n == 16
    monkeypatch.setattr(kernel_module, "_prefill_smem", lambda device: kernel_module.PREFILL_SMEM)
    assert prefill_plan(1, heads, kv_heads, 256, 2048, 2, torch.device("cpu")).block_n == 32


@pytest.mark.parametrize("num_seqs,kv_heads,context,tile_rows", [
    (1, 2, 4096, 16), (1, 2, 4096, 64), (1, 4, 32768, 64), (4, 2, 512, 16), (16, 4, 512, 64), (16, 4, 4096, 16)])
def test_split_plan_fills_one_wave_and_bounds_partials(monkeypatch, num_seqs, kv_heads, context, tile_rows):
    """On 132 SMs (H200): at most PROGRAMS_PER_SM programs per SM, at least half that many unless a
    split's floor (MIN_SPLIT_LEN, the tile rows, one chunk) stops it; a power of two."""
    monkeypatch.setattr(kernel_module, "_sm_count", lambda device: 132)
    split = kernel_module.plan_splits(num_seqs, kv_heads, context, tile_rows, 32, torch.device("cpu"))
    programs = num_seqs * kv_heads * -(-context // split)
    target = kernel_module.PROGRAMS_PER_SM * 132
    floor = max(32, kernel_module.MIN_SPLIT_LEN, tile_rows)
    assert split & (split - 1) == 0 and split >= floor
    assert programs <= max(target, num_seqs * kv_heads)
    assert programs > target // 2 or split == floor or split >= context


def test_dispatch_sends_every_step_to_a_kernel(monkeypatch):
    """With GPU forms allowed on any device (as on CUDA), every step takes the kernels: steps whose rows fit
    the split kernel's tile (<= 16 rows per sequence, <= 128 tile rows) the split-KV pair, longer ones (a
    prefill chunk; 16 rows of G = 16) the prefill kernel; on CPU tensors, the torch form."""
    forms = {paged_attention_triton: "triton", paged_attention_torch: "torch"}
    launched = []
    for kind in ("decode", "prefill"):
        spy = lambda *args, kind=kind, **kwargs: launched.append(kind)  # noqa: E731
        monkeypatch.setattr(kernel_module, f"paged_attention_{kind}", spy)
    picked, on_cpu = [], []
    for rows, heads in ((1, 6), (5, 6), (16, 6), (17, 6), (300, 6), (8, 16), (16, 16)):
        case = make_case([300], [rows], 16, 8, seed=rows, pad_rows=0, heads=heads, kv_heads=1)
        meta = StepMeta.build(case.batch, case.pools)
        with forced_gpu([paged_attention]):
            picked.append(forms[paged_attention.pick(case.q, case.key_cache, case.value_cache, meta)])
            paged_attention(case.q, case.key_cache, case.value_cache, meta)
        on_cpu.append(forms[paged_attention.pick(case.q, case.key_cache, case.value_cache, meta)])
    assert picked == ["triton"] * 7
    assert launched == ["decode", "decode", "decode", "prefill", "prefill", "decode", "prefill"]
    assert on_cpu == ["torch"] * 7


def test_step_meta_builds_the_torch_forms_fields_on_first_use():
    """A step that the kernel serves never builds kv_gather, kv_valid or query_positions (a CUDA graph would
    replay their kernels every step); the torch form builds them when it reads them, from the step's fields."""
    case = make_case([45, 7], [5, 1], 16, 8, seed=5, pad_rows=0)
    meta = StepMeta.build(case.batch, case.pools)
    lazy = ("kv_gather", "kv_valid", "query_positions")
    assert not set(lazy) & set(vars(meta))
    paged_attention_torch(case.q, case.key_cache, case.value_cache, meta)
    assert set(lazy) <= set(vars(meta))
    assert meta.query_positions.tolist() == [[45 - 5 + i for i in range(5)], [7 - 1, -1, -1, -1, -1]]


def test_refusals():
    case = make_case([20], [2], 16, 8, seed=0, pad_rows=0)
    b = case.batch
    args = (case.key_cache, case.value_cache, b.block_tables, b.context_lens, b.cu_seqlens, b.positions)
    with pytest.raises(ValueError, match="max_query_len=17"):
        paged_attention_decode(case.q, *args, max_query_len=17, page_size=8)
    with pytest.raises(ValueError, match="Hkv dividing H"):
        paged_attention_decode(case.q[:, :5], *args, max_query_len=2, page_size=8)
    with pytest.raises(ValueError, match="split_len=24: expected a positive multiple of block_n=16"):
        paged_attention_decode(case.q, *args, max_query_len=2, page_size=8, split_len=24, block_n=16)
    with pytest.raises(ValueError, match="block_n=24"):
        paged_attention_decode(case.q, *args, max_query_len=2, page_size=8, split_len=48, block_n=24)
    with pytest.raises(ValueError, match="block_m=24: expected a power of two >= 16"):
        paged_attention_prefill(case.q, *args, max_query_len=2, page_size=8, block_m=24)
    with pytest.raises(ValueError, match="heads_per_program=2: expected a power of two dividing G=3"):
        paged_attention_prefill(case.q, *args, max_query_len=2, page_size=8, heads_per_program=2)
    with pytest.raises(ValueError, match="max_query_len=0"):
        paged_attention_prefill(case.q, *args, max_query_len=0, page_size=8)


PLANTED = {"verify": [5, 3, 1], "prefill": [30, 20, 7]}  # rows per sequence of contexts 45, 32, 7


def shifted(meta: StepMeta) -> StepMeta:
    return replace(meta, positions=meta.positions + 1)  # query_positions follow, built anew


@pytest.mark.parametrize("step", PLANTED)
def test_planted_bug_off_by_one_causal_mask_is_caught(impl_device, report, step):
    """Rows that see the key one past their position (as a ``t <= p + 1`` mask would) fail the comparison."""
    impl, device = impl_device
    case = make_case([45, 32, 7], PLANTED[step], 16, 8, seed=3)
    with pytest.raises(AssertionError, match="rms-relative"):
        check(pick(impl, paged_attention_torch, paged_attention_triton), case, device, torch.float32, report,
              meta_edit=shifted)


@pytest.mark.parametrize("step", PLANTED)
def test_planted_bug_read_past_the_context_is_caught(impl_device, report, step):
    """One key past a sequence's context is NaN poison: reading it must make the result non-finite. The prefill
    kernel loads no key past a block's last row, so there the rows move one on with the context."""
    impl, device = impl_device
    case = make_case([45, 32, 7], PLANTED[step], 16, 8, seed=4)
    case.batch = replace(case.batch, context_lens=case.batch.context_lens + 1)
    with pytest.raises(AssertionError, match="non-finite"):
        check(pick(impl, paged_attention_torch, paged_attention_triton), case, device, torch.float32, report,
              meta_edit=shifted if step == "prefill" else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("rows,tuning", [([5, 3, 1], {"split_len": 16, "block_n": 16}),
                                         ([30, 20, 7], {"block_m": 32, "block_n": 16})], ids=["verify", "prefill"])
def test_kernel_replays_in_a_cuda_graph(report, rows, tuning):
    """Captured once, replayed on new queries in the captured buffer: equal to the eager call (deterministic)."""
    case = make_case([45, 32, 7], rows, 32, 16, seed=5, spare_pages=3)
    pools = CachePools(case.pools.cfg, case.pools.num_pages, 16, 4, max(rows), torch.float32, "cuda")
    meta = StepMeta.build(batch_to(case.batch, "cuda"), pools)
    q, k, v = (t.cuda() for t in (case.q, case.key_cache, case.value_cache))
    paged_attention_triton(q, k, v, meta, **tuning)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention_triton(q, k, v, meta, **tuning)
    fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).cuda()
    q.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, paged_attention_triton(fresh, k, v, meta, **tuning))
    assert captured[case.padding_rows.cuda()].eq(0).all()
    report.numeric("graph/float32", captured, paged_attention_torch(fresh, k, v, meta), NUMERIC_BOUND[torch.float32])
