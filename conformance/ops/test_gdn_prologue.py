"""fast/kernels/gdn/gdn_prologue.py (and the model's torch form ``gdn.gdn_prologue_torch``) vs
reference/model/gdn.py (causal_conv1d, silu, l2norm, the decay and write-strength formulas of
``GatedDeltaNet.forward``), computed in float64 per sequence.

Steps: decode (one row per sequence), ragged verify steps and prefill chunks (sequences shorter than
K - 1, as long and longer, so the new conv state mixes old columns and the chunk's inputs), each with a sequence that starts from
the zero state (first row at position 0: its slot holds NaN and must not be read), sequences that
continue from their slots in no order, and a padding sequence (state slot -1: the zero state, the
trash slot). Odd head dims (Dk = 5, Dv = 7; Dk = 8, Dv = 12), GVA ratios 2 and 3, conv kernels 2, 3
and 4, verify rows past K - 1 (taps read the step's own earlier rows). ``a + dt_bias`` spans about
+-40, past softplus's threshold of 20 both ways.

Poison: conv inputs, b and a are column slices of a NaN-filled projection; every state slot no
sequence reads is NaN; the verify scratch is NaN with a spare sequence and row. Checks: q, k, v, g,
beta NUMERIC (fp32 1e-5, bf16 2e-2; the fast side rounds the conv output to the model dtype);
decode and prefill: each real sequence's slot holds the reference's new conv state EXACTLY (a copy of inputs
and old state), other slots untouched (the trash slot aside); verify: the slots untouched, the
scratch holds every row's conv input EXACTLY at [b, r] and NaN elsewhere.

Planted bug: the conv taps in reverse order must fail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.gdn.gdn_prologue import gdn_prologue_triton
from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.model.batch import PAD_SLOT, ForwardBatch
from dflash2.fast.kernels.gdn.gdn_prologue import gdn_prologue, gdn_prologue_torch
from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.step import StepMeta
from dflash2.reference.model.gdn import causal_conv1d, l2norm
from dflash2.reference.tiny.target import tiny_target_config

NUM_SLOTS = 4  # the pool has NUM_SLOTS + 1 rows: the last is the trash slot
SLOTS = (2, 0, 3)  # the real sequences' slots
SPARE = 1  # poisoned verify scratch sequences and rows beyond [:B, :Tq]
DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class Case:
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    lens: list[int]  # rows per sequence, the padding sequence last
    zero_start: tuple[int, ...]  # real sequences whose first row sits at position 0
    proj: torch.Tensor  # [N, Cd + 2 Hv] conv inputs, b, a (fp32 values)
    pool: torch.Tensor  # [NUM_SLOTS + 1, Cd, K-1], NaN in every slot no sequence reads
    weight: torch.Tensor  # [Cd, K]
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    batch: ForwardBatch
    pools: CachePools  # for StepMeta.build only (state_index, the trash slot); its own tensors are unused

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def is_verify(self) -> bool:
        return self.batch.is_verify


def make_case(lens: list[int], key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
              zero_start: tuple[int, ...], verify: bool, seed: int) -> Case:
    """``lens``: rows of the real sequences; a padding sequence of ``max(lens)`` rows comes last."""
    gen = torch.Generator().manual_seed(seed)
    lens = list(lens) + [max(lens)]
    rows = sum(lens)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    proj = torch.cat([torch.randn(rows, conv_dim, generator=gen),  # conv inputs
                      torch.randn(rows, value_heads, generator=gen) * 4,  # b
                      torch.randn(rows, value_heads, generator=gen) * 15], dim=1)  # a
    pool = torch.full((NUM_SLOTS + 1, conv_dim, kernel - 1), float("nan"))
    for b, slot in enumerate(SLOTS[:len(lens) - 1]):
        if b not in zero_start:
            pool[slot] = torch.randn(conv_dim, kernel - 1, generator=gen)
    weight = torch.randn(conv_dim, kernel, generator=gen) * 0.5
    a_log = torch.randn(value_heads, generator=gen) * 0.5
    dt_bias = torch.randn(value_heads, generator=gen) * 3

    starts = [0 if b in zero_start else 10 + 7 * b for b in range(len(lens) - 1)] + [0]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    num_seqs = len(lens)
    longs = dict(dtype=torch.long)
    batch = ForwardBatch(
        token_ids=torch.zeros(rows, **longs), positions=positions,
        cu_seqlens=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        state_slots=torch.tensor(list(SLOTS[:num_seqs - 1]) + [PAD_SLOT], **longs),
        kv_slot_mapping=torch.full((rows,), PAD_SLOT, **longs),
        block_tables=torch.full((num_seqs, 1), -1, dtype=torch.int32), context_lens=torch.zeros(num_seqs, **longs),
        is_verify=verify, logits_rows=torch.arange(rows), max_query_len=max(lens))
    pools = CachePools(tiny_target_config("tiny-dense"), 2, 8, NUM_SLOTS, max(lens), torch.float32, "cpu")
    return Case(key_heads, key_dim, value_heads, value_dim, lens, zero_start, proj, pool, weight, a_log, dt_bias,
                batch, pools)


def step_meta(case: Case, device: str) -> StepMeta:
    fields = ("token_ids", "positions", "cu_seqlens", "state_slots", "kv_slot_mapping", "block_tables",
              "context_lens", "logits_rows")
    batch = replace(case.batch, **{f: getattr(case.batch, f).to(device) for f in fields})
    pools = case.pools if device == "cpu" else CachePools(case.pools.cfg, 2, 8, NUM_SLOTS, max(case.lens),
                                                          torch.float32, device)
    return StepMeta.build(batch, pools)


@dataclass
class Run:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    proj: torch.Tensor  # the poisoned projection the implementation read (model dtype)
    pool: torch.Tensor  # after the step
    pool_before: torch.Tensor
    scratch: torch.Tensor | None  # the verify scratch after the step


def run(impl: str, case: Case, device: str, dtype: torch.dtype, weight: torch.Tensor | None = None) -> Run:
    rows, width = case.proj.shape
    buf = torch.full((rows, width + 4), float("nan"), dtype=dtype, device=device)
    buf[:, 2:2 + width] = case.proj.to(device, dtype)
    proj = buf[:, 2:2 + width]
    cd, hv = case.conv_dim, case.value_heads
    conv_in, b, a = proj[:, :cd], proj[:, cd:cd + hv], proj[:, cd + hv:]
    pool = case.pool.to(device, dtype, copy=True)  # the step writes it
    pool_before = pool.clone()
    scratch = None
    if case.is_verify:
        scratch = torch.full((len(case.lens) + SPARE, max(case.lens) + SPARE, cd), float("nan"), dtype=dtype,
                             device=device)
    weight = (case.weight if weight is None else weight).to(device, dtype)
    fn = pick(impl, gdn_prologue_torch, gdn_prologue_triton)
    q, k, v, g, beta = fn(conv_in, b, a, pool, weight, -torch.exp(case.a_log).to(device), case.dt_bias.to(device),
                          step_meta(case, device), case.key_heads, case.key_dim, scratch)
    return Run(q, k, v, g, beta, proj, pool, pool_before, scratch)


def reference(case: Case, got: Run) -> dict[str, torch.Tensor]:
    """Per sequence, in float64, on the inputs as the model dtype holds them."""
    proj = got.proj.double().cpu()
    pool = got.pool_before.double().cpu()
    weight = case.weight.to(got.proj.dtype).double()
    cd, hk, dk, hv, dv = case.conv_dim, case.key_heads, case.key_dim, case.value_heads, case.value_dim
    out = {name: [] for name in ("q", "k", "v", "g", "beta")}
    states = []
    first = 0
    for b, rows in enumerate(case.lens):
        x = proj[first:first + rows]
        padding = b == len(case.lens) - 1
        start = torch.zeros(cd, weight.shape[1] - 1, dtype=torch.float64) if padding or b in case.zero_start \
            else pool[SLOTS[b]]
        y, state = causal_conv1d(x[:, :cd], start, weight)
        states.append(state)
        q, k, v = torch.split(F.silu(y), [hk * dk, hk * dk, hv * dv], dim=-1)
        out["q"].append(l2norm(q.reshape(rows, hk, dk)) / dk ** 0.5)
        out["k"].append(l2norm(k.reshape(rows, hk, dk)))
        out["v"].append(v.reshape(rows, hv, dv))
        out["g"].append(-torch.exp(case.a_log.double()) * F.softplus(x[:, cd + hv:] + case.dt_bias.double()))
        out["beta"].append(torch.sigmoid(x[:, cd:cd + hv]))
        first += rows
    expected = {name: torch.cat(parts) for name, parts in out.items()}
    expected["states"] = states
    return expected


def check(impl: str, case: Case, device: str, dtype: torch.dtype, report, weight=None) -> Run:
    got = run(impl, case, device, dtype, weight)
    expected = reference(case, got)
    name = str(dtype)[6:]
    for what in ("q", "k", "v", "g", "beta"):
        t = getattr(got, what)
        assert t.dtype == (dtype if what == "v" else torch.float32), f"{what}: dtype {t.dtype}"
        report.numeric(f"{what}/{name}", t, expected[what], NUMERIC_BOUND[dtype])
    pool, before = got.pool.cpu(), got.pool_before.cpu()
    real = list(SLOTS[:len(case.lens) - 1])
    if case.is_verify:
        assert pool.isnan().equal(before.isnan()) and pool.nan_to_num().equal(before.nan_to_num()), \
            "a verify step changed the conv states"
        scratch = got.scratch.cpu()
        written = torch.zeros(scratch.shape[:2], dtype=torch.bool)
        first = 0
        for b, rows in enumerate(case.lens):
            written[b, :rows] = True
            assert torch.equal(scratch[b, :rows], got.proj.cpu()[first:first + rows, :case.conv_dim]), \
                f"verify scratch of sequence {b} is not its rows' conv inputs"
            first += rows
        assert scratch[~written].isnan().all(), "a verify scratch row outside the step's rows was written"
    else:
        for b, slot in enumerate(real):
            assert torch.equal(pool[slot], expected["states"][b].to(dtype)), f"conv state of sequence {b}"
        others = [s for s in range(NUM_SLOTS) if s not in real]
        assert pool[others].isnan().equal(before[others].isnan()), "a slot no sequence owns was written"
    return got


CASES = {  # lens (real sequences), Hk, Hv, Dk, Dv, K, zero-start sequences, verify
    "decode-K4": ([1, 1, 1], 2, 4, 8, 12, 4, (1,), False),
    "decode-K2": ([1, 1], 1, 2, 4, 6, 2, (0,), False),
    "verify-ragged-K3": ([3, 1, 4], 1, 3, 5, 7, 3, (0,), True),
    "verify-K4-past-window": ([5, 2], 2, 4, 8, 12, 4, (), True),
    # prefill chunks: sequences shorter than K - 1 (the new state keeps old columns), as long, and longer
    "prefill-ragged-K4": ([1, 3, 6], 2, 4, 8, 12, 4, (2,), False),
    "prefill-short-K4": ([2, 1, 5], 1, 2, 4, 6, 4, (1,), False),
    "prefill-K3-one-long": ([9, 2], 1, 3, 5, 7, 3, (0,), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gdn_prologue_matches_reference(impl_device, report, name):
    impl, device = impl_device
    case = make_case(*CASES[name], seed=len(name))
    for dtype in DTYPES:
        got = check(impl, case, device, dtype, report)
        if impl == "triton" and (dtype == torch.float32 or device == "cuda"):
            twin = run("torch", case, device, dtype)
            for what in ("q", "k", "v", "g", "beta"):
                report.numeric(f"twin-{what}/{str(dtype)[6:]}", getattr(got, what), getattr(twin, what),
                               NUMERIC_BOUND[dtype])
            assert got.pool.isnan().equal(twin.pool.isnan())
            if case.is_verify:
                assert got.scratch.nan_to_num().equal(twin.scratch.nan_to_num())


def test_refusals():
    case = make_case([1, 1], 1, 2, 4, 6, 4, (), False, seed=2)
    meta = step_meta(case, "cpu")
    cd = case.conv_dim
    x, b, a = case.proj[:, :cd], case.proj[:, cd:cd + 2], case.proj[:, cd + 2:]
    args = dict(conv_states=case.pool, neg_decay=torch.ones(2), dt_bias=torch.ones(2), meta=meta, key_heads=1,
                key_dim=4)
    with pytest.raises(ValueError, match="conv_in width"):
        gdn_prologue_triton(x, b, a, conv_weight=case.weight, **{**args, "key_dim": 10})
    with pytest.raises(ValueError, match="conv_weight"):
        gdn_prologue_triton(x, b, a, conv_weight=case.weight.t(), **args)
    with pytest.raises(ValueError, match="conv_states"):
        gdn_prologue_triton(x, b, a, conv_weight=case.weight, **{**args, "conv_states": case.pool[:, :, :2]})
    with pytest.raises(ValueError, match="dt_bias"):
        gdn_prologue_triton(x, b, a, conv_weight=case.weight, **{**args, "dt_bias": torch.ones(3)})


def test_dispatch():
    """With GPU forms allowed on any device (as on CUDA), decode, verify and prefill steps take the kernel; on CPU
    tensors, always the torch form."""
    forms = {gdn_prologue_triton: "triton", gdn_prologue_torch: "torch"}
    picked, on_cpu = [], []
    for lens, verify in [([1, 1], False), ([3, 1], True), ([3, 1], False)]:
        case = make_case(lens, 1, 2, 4, 6, 4, (), verify, seed=3)
        cd = case.conv_dim
        scratch = torch.zeros(4, 4, cd) if verify else None
        args = (case.proj[:, :cd], case.proj[:, cd:cd + 2], case.proj[:, cd + 2:], case.pool, case.weight,
                torch.ones(2), torch.ones(2), step_meta(case, "cpu"), 1, 4, scratch)
        with forced_gpu([gdn_prologue]):
            picked.append(forms[gdn_prologue.pick(*args)])
        on_cpu.append(forms[gdn_prologue.pick(*args)])
    assert picked == ["triton", "triton", "triton"]
    assert on_cpu == ["torch"] * 3


def test_planted_bug_reversed_taps_are_caught(impl_device, report):
    impl, device = impl_device
    case = make_case(*CASES["verify-ragged-K3"], seed=4)
    with pytest.raises(AssertionError, match="rms-relative"):
        check(impl, case, device, torch.float32, report, weight=case.weight.flip(-1))
