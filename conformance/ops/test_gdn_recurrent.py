"""fast/kernels/gdn/gdn_recurrent.py vs reference/delta_rule.gated_delta_rule_recurrent: B sequences of
ragged row counts (decode, verify, a prefill longer than 16 rows), GVA (Hv = 2 or 3 x Hk), odd
head dims and Dv split over several program blocks, starting states read through ``state_index``
from a pool whose other rows are NaN (a negative index starts from zeros). NUMERIC on the outputs
and the final states. EXACT on the verify rows' stored inputs (``verify_rows``: k, g, beta as the
fp32 values the recurrence used, v in its own dtype: what the commit replays,
conformance/ops/test_gdn_commit.py) and on what must stay untouched: the state pool, and every
scratch row past a sequence's rows (NaN-poisoned). With ``final_state_index`` (the decode step's
in-place write into the pool): EXACT against the returned final states, rows no sequence writes
untouched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.gdn.gdn_recurrent import (VerifyRowInputs, gated_delta_rule_verify_torch,
                                                gated_delta_rule_verify_triton)
from dflash2.reference.model.delta_rule import gated_delta_rule_recurrent

EXTRA_SCRATCH = 2  # poisoned scratch rows and sequences beyond [:B, :max_rows]


@dataclass
class Case:
    q: torch.Tensor  # [N, Hk, Dk], L2-normalised and scaled by Dk^-1/2
    k: torch.Tensor  # [N, Hk, Dk], L2-normalised
    v: torch.Tensor  # [N, Hv, Dv]
    g: torch.Tensor  # [N, Hv], log-decay <= 0
    beta: torch.Tensor  # [N, Hv]
    pool: torch.Tensor  # [S, Hv, Dk, Dv] fp32, NaN in the rows no sequence reads
    state_index: torch.Tensor  # [B], -1: starts from zeros
    cu_seqlens: torch.Tensor  # [B+1]
    max_rows: int
    expected_o: torch.Tensor  # [N, Hv, Dv] from the reference
    expected_final: torch.Tensor  # [B, Hv, Dk, Dv]

    @property
    def lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def make_case(lens: list[int], key_heads: int, value_heads: int, key_dim: int, value_dim: int, seed: int,
              zero_start: tuple[int, ...] = (1,), max_rows: int | None = None) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rows, batch = sum(lens), len(lens)
    max_rows = max(lens) if max_rows is None else max_rows
    q = F.normalize(torch.randn(rows, key_heads, key_dim, generator=gen), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(rows, key_heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(rows, value_heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(rows, value_heads, generator=gen)) * torch.rand(rows, value_heads, generator=gen) * 2
    beta = torch.sigmoid(torch.randn(rows, value_heads, generator=gen))
    num_states = batch + 3
    pool = torch.full((num_states, value_heads, key_dim, value_dim), float("nan"))
    state_index = torch.randperm(num_states, generator=gen)[:batch]
    for b in range(batch):
        if b in zero_start:
            state_index[b] = -1
        else:
            pool[state_index[b]] = torch.randn(value_heads, key_dim, value_dim, generator=gen)

    ratio = value_heads // key_heads
    cu = torch.tensor([0] + lens).cumsum(0)
    outputs, finals = [], []
    for b in range(batch):
        state = torch.zeros(value_heads, key_dim, value_dim) if state_index[b] < 0 else pool[state_index[b]]
        for t in range(cu[b], cu[b + 1]):
            step = slice(t, t + 1)
            o, state = gated_delta_rule_recurrent(q[step].repeat_interleave(ratio, dim=1),
                                                  k[step].repeat_interleave(ratio, dim=1), v[step], g[step],
                                                  beta[step], state)
            outputs.append(o)
        finals.append(state)
    return Case(q, k, v, g, beta, pool, state_index, cu, max_rows, torch.cat(outputs), torch.stack(finals))


def poisoned_scratch(case: Case, device: str, v_dtype: torch.dtype) -> VerifyRowInputs:
    """NaN verify scratch ``[B + EXTRA_SCRATCH, max_rows + EXTRA_SCRATCH, ...]`` for the case's shapes."""
    seqs, rows = case.cu_seqlens.shape[0] - 1 + EXTRA_SCRATCH, case.max_rows + EXTRA_SCRATCH
    nan = dict(fill_value=float("nan"), device=device)
    return VerifyRowInputs(torch.full((seqs, rows, *case.k.shape[1:]), **nan),
                           torch.full((seqs, rows, *case.v.shape[1:]), dtype=v_dtype, **nan),
                           torch.full((seqs, rows, case.g.shape[1]), **nan),
                           torch.full((seqs, rows, case.g.shape[1]), **nan))


def check_stored_inputs(case: Case, scratch: VerifyRowInputs, dtype: torch.dtype) -> None:
    """EXACT: row t of sequence b at ``[b, t]`` as the recurrence took it (q, k, v in ``dtype``; k, g, beta
    stored as fp32, v as itself); every other scratch row still NaN."""
    lens = case.lens
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    row_in_seq = torch.cat([torch.arange(n) for n in lens])
    written = torch.zeros(scratch.k.shape[:2], dtype=torch.bool)
    written[seq_index, row_in_seq] = True
    fed = (case.k.to(dtype).float(), case.v.to(dtype), case.g, case.beta)
    for name, stored, x in zip(VerifyRowInputs._fields, scratch, fed):
        stored = stored.cpu()
        assert torch.equal(stored[seq_index, row_in_seq], x.to(stored.dtype)), f"stored {name} differs"
        assert stored[~written].isnan().all(), f"a {name} scratch row past a sequence's rows was written"


def check_gdn_recurrent(fn, case: Case, device: str, dtype: torch.dtype, report, store_inputs: bool = True,
                        **kwargs) -> None:
    """Run ``fn`` on the case (q, k, v in ``dtype``; g, beta and states fp32) and hold it to the reference."""
    pool = case.pool.to(device)
    pool_before = pool.clone()
    scratch = poisoned_scratch(case, device, dtype) if store_inputs else None
    o, final = fn(case.q.to(device, dtype), case.k.to(device, dtype), case.v.to(device, dtype), case.g.to(device),
                  case.beta.to(device), pool, case.cu_seqlens.to(device), case.max_rows,
                  state_index=case.state_index.to(device), verify_rows=scratch, **kwargs)
    name = str(dtype)[6:]
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert pool.isnan().equal(pool_before.isnan()) and pool.nan_to_num().equal(pool_before.nan_to_num()), \
        "the state pool changed"
    report.numeric(f"o/{name}", o, case.expected_o, NUMERIC_BOUND[dtype])
    report.numeric(f"final/{name}", final, case.expected_final, NUMERIC_BOUND[dtype])
    if store_inputs:
        check_stored_inputs(case, scratch, dtype)


SHAPES = [  # row counts per sequence, Hk, Hv, Dk, Dv, sequences starting from zeros
    ([1, 1, 1, 1, 1], 2, 4, 16, 16, (1,)),  # decode
    ([4, 2, 4], 2, 4, 24, 24, (2,)),  # ragged verify, k = 3; Dv over two 16-wide blocks
    ([5, 3], 1, 3, 8, 12, ()),  # the tiny targets' GDN shapes
    ([19, 1, 7], 2, 4, 16, 20, (0,)),  # prefill past 16 rows: the row loop runs 32
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"R{max(s[0])}x{len(s[0])}-Hk{s[1]}-Hv{s[2]}-Dk{s[3]}-Dv{s[4]}")
def test_gdn_recurrent_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    lens, key_heads, value_heads, key_dim, value_dim, zero_start = shape
    case = make_case(lens, key_heads, value_heads, key_dim, value_dim, seed=len(lens) * 100 + key_dim,
                     zero_start=zero_start)
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    kwargs = {"block_v": 16} if impl == "triton" else {}
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        check_gdn_recurrent(fn, case, device, dtype, report, **kwargs)


def test_gdn_recurrent_without_stored_inputs(impl_device, report):
    """Decode, and a prefill past 16 rows (each program loops to its own sequence's length): no scratch, the final
    states only; and stored inputs without the final states return None."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    case = make_case([1, 1, 1], 2, 4, 16, 16, seed=3)
    check_gdn_recurrent(fn, case, device, torch.float32, report, store_inputs=False)
    case = make_case([33, 0, 17, 5], 2, 4, 16, 20, seed=5, zero_start=(2,))
    check_gdn_recurrent(fn, case, device, torch.float32, report, store_inputs=False)
    case = make_case([3, 2], 2, 4, 16, 16, seed=4)
    scratch = poisoned_scratch(case, device, torch.float32)
    o, final = fn(case.q.to(device), case.k.to(device), case.v.to(device), case.g.to(device), case.beta.to(device),
                  case.pool.to(device), case.cu_seqlens.to(device), 3, state_index=case.state_index.to(device),
                  verify_rows=scratch, output_final_state=False)
    assert final is None
    report.numeric("o/float32", o, case.expected_o, NUMERIC_BOUND[torch.float32])
    check_stored_inputs(case, scratch, torch.float32)


def test_gdn_recurrent_stores_bf16_v_into_fp32_scratch(impl_device, report):
    """v stored into an fp32 scratch keeps its bf16 value exactly; fp32 v into a bf16 scratch is refused
    (it would round, and the commit would replay other values than the recurrence used)."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    case = make_case([4, 2, 4], 2, 4, 16, 16, seed=10)
    scratch = poisoned_scratch(case, device, torch.float32)
    inputs = (case.q.to(device), case.k.to(device), case.v.to(device, torch.bfloat16), case.g.to(device),
              case.beta.to(device), case.pool.to(device), case.cu_seqlens.to(device), 4)
    fn(*inputs, state_index=case.state_index.to(device), verify_rows=scratch)
    stored = scratch.v.cpu()[torch.repeat_interleave(torch.arange(3), torch.tensor(case.lens)),
                             torch.cat([torch.arange(n) for n in case.lens])]
    assert torch.equal(stored, case.v.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="no rounding"):
        fn(*inputs[:2], case.v.to(device), *inputs[3:], verify_rows=poisoned_scratch(case, device, torch.bfloat16))


@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [3, 1, 2], [19, 1, 40]], ids=["decode", "ragged", "prefill"])
def test_gdn_recurrent_writes_final_states_in_place(impl_device, report, lens):
    """``final_state_index``: the final states land in the pool itself, read and written in place (sequence b
    reads row ``state_index[b]`` and writes the same row; the zero-start one reads nothing and writes a row
    that held NaN), bit for bit the states the kernel returns without it; no other row changes."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    kwargs = {"block_v": 16} if impl == "triton" else {}
    case = make_case(lens, 2, 4, 16, 20, seed=9, zero_start=(1,))
    free = [i for i in range(case.pool.shape[0]) if i not in case.state_index.tolist()]
    write_index = torch.where(case.state_index < 0, free[0], case.state_index)  # [B]
    inputs = [t.to(device) for t in (case.q, case.k, case.v, case.g, case.beta)]
    args = dict(state_index=case.state_index.to(device), **kwargs)
    pool = case.pool.to(device)
    o_dense, final = fn(*inputs, pool.clone(), case.cu_seqlens.to(device), case.max_rows, **args)
    o, none = fn(*inputs, pool, case.cu_seqlens.to(device), case.max_rows, output_final_state=False,
                 final_state_index=write_index.to(device), **args)
    assert none is None
    assert torch.equal(o, o_dense) and torch.equal(pool[write_index.to(device)], final), \
        "in place differs from the returned final states"
    report.numeric("pool/float32", pool[write_index.to(device)], case.expected_final, NUMERIC_BOUND[torch.float32])
    others = [i for i in range(case.pool.shape[0]) if i not in write_index.tolist()]
    assert pool.cpu()[others].isnan().equal(case.pool[others].isnan()), "a row no sequence writes changed"
    assert pool.cpu()[others].nan_to_num().equal(case.pool[others].nan_to_num()), "a row no sequence writes changed"


def test_gdn_recurrent_dense_states_without_index(impl_device, report):
    """Without ``state_index`` sequence b starts from ``initial_state[b]`` (the engine's gathered states)."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    case = make_case([2, 4, 1], 2, 4, 16, 16, seed=5, zero_start=())
    states = case.pool[case.state_index].to(device)
    o, final = fn(case.q.to(device), case.k.to(device), case.v.to(device), case.g.to(device), case.beta.to(device),
                  states, case.cu_seqlens.to(device), 4)
    report.numeric("o/float32", o, case.expected_o, NUMERIC_BOUND[torch.float32])
    report.numeric("final/float32", final, case.expected_final, NUMERIC_BOUND[torch.float32])


def test_planted_bug_inputs_one_row_late_is_caught(impl_device, report):
    """Each row's inputs stored at scratch row r + 1 must fail."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)

    def one_row_late(*args, verify_rows, **kwargs):
        out = fn(*args, verify_rows=verify_rows, **kwargs)
        for t in verify_rows:
            t[:, 1:] = t[:, :-1].clone()
        return out

    with pytest.raises(AssertionError, match="stored k differs"):
        check_gdn_recurrent(one_row_late, make_case([4, 2, 4], 2, 4, 16, 16, seed=6), device, torch.float32, report)


def test_planted_bug_wrong_starting_state_is_caught(impl_device, report):
    """Each sequence reading the next sequence's starting state must fail."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    case = make_case([3, 3, 3], 2, 4, 16, 16, seed=7, zero_start=())
    expected_index = case.state_index
    case.state_index = expected_index.roll(1)
    with pytest.raises(AssertionError, match="rms-relative"):
        check_gdn_recurrent(fn, case, device, torch.float32, report)


def _decay_after_update_torch(q, k, v, g, beta, initial_state, cu_seqlens, max_rows, *, state_index, verify_rows):
    """A planted bug: S_t = exp(g_t) (S_{t-1} + k_t u_t^T) with u_t read from the undecayed state."""
    ratio = v.shape[1] // q.shape[1]
    outputs, finals = [], []
    for b in range(cu_seqlens.shape[0] - 1):
        s = torch.zeros_like(initial_state[0]) if state_index[b] < 0 else initial_state[state_index[b]].clone()
        rows = range(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
        for r, t in enumerate(rows):
            qt, kt = q[t].repeat_interleave(ratio, dim=0), k[t].repeat_interleave(ratio, dim=0)  # [Hv, Dk]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, kt))
            s = torch.exp(g[t])[:, None, None] * (s + kt[:, :, None] * u[:, None, :])
            outputs.append(torch.einsum("hkv,hk->hv", s, qt))
        finals.append(s)
    return torch.stack(outputs), torch.stack(finals)


def test_planted_bug_decay_after_update_is_caught(report):
    with pytest.raises(AssertionError, match="rms-relative"):
        check_gdn_recurrent(_decay_after_update_torch, make_case([4, 2, 4], 2, 4, 16, 16, seed=8), "cpu",
                            torch.float32, report, store_inputs=False)


def test_short_prefill_chunks_take_the_in_place_recurrence():
    """The dispatch rule of ``gdn_recurrence``'s GPU form: verify steps at any row count, and decode steps and
    prefill chunks of up to SHORT_PREFILL_ROWS rows a sequence, run the recurrence in place; longer prefill chunks
    gather the states for fla's chunked kernels."""
    from types import SimpleNamespace

    from dflash2.fast.kernels.gdn.delta_rule import SHORT_PREFILL_ROWS, _fits_in_place

    def fits(rows: int, is_verify: bool = False) -> bool:
        return _fits_in_place(*[None] * 6, SimpleNamespace(is_verify=is_verify, max_query_len=rows), None)

    assert fits(1) and fits(129) and fits(SHORT_PREFILL_ROWS)
    assert not fits(SHORT_PREFILL_ROWS + 1) and not fits(2048)
    assert fits(SHORT_PREFILL_ROWS + 1, is_verify=True)
