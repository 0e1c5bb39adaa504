"""fast/kernels/gdn_recurrent.py vs reference/delta_rule.gated_delta_rule_recurrent: B sequences of
ragged row counts (decode, verify, a prefill longer than 16 rows), GVA (Hv = 2 or 3 x Hk), odd
head dims and Dv split over several program blocks, starting states read through ``state_index``
from a pool whose other rows are NaN (a negative index starts from zeros). NUMERIC on the outputs,
the final states and every captured row state; EXACT on what must stay untouched: the state pool,
and every scratch row outside ``[:B, :max_rows]`` (NaN-poisoned). With ``final_state_index`` (the
decode step's in-place write into the pool): EXACT against the returned final states, rows no
sequence writes untouched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.gdn_recurrent import gated_delta_rule_verify_torch, gated_delta_rule_verify_triton
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
    expected_rows: torch.Tensor  # [B, max_rows, Hv, Dk, Dv]: the state after each row (the final one past the end)


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
    outputs, finals, row_states = [], [], []
    for b in range(batch):
        state = torch.zeros(value_heads, key_dim, value_dim) if state_index[b] < 0 else pool[state_index[b]]
        states = []
        for t in range(cu[b], cu[b + 1]):
            step = slice(t, t + 1)
            o, state = gated_delta_rule_recurrent(q[step].repeat_interleave(ratio, dim=1),
                                                  k[step].repeat_interleave(ratio, dim=1), v[step], g[step],
                                                  beta[step], state)
            outputs.append(o)
            states.append(state)
        states += [state] * (max_rows - lens[b])
        finals.append(state)
        row_states.append(torch.stack(states))
    return Case(q, k, v, g, beta, pool, state_index, cu, max_rows, torch.cat(outputs), torch.stack(finals),
                torch.stack(row_states))


def check_gdn_recurrent(fn, case: Case, device: str, dtype: torch.dtype, report, capture: bool = True,
                        **kwargs) -> None:
    """Run ``fn`` on the case (q, k, v in ``dtype``; g, beta and states fp32) and hold it to the reference."""
    batch, max_rows = case.cu_seqlens.shape[0] - 1, case.max_rows
    pool = case.pool.to(device)
    pool_before = pool.clone()
    scratch = None
    if capture:
        scratch = torch.full((batch + EXTRA_SCRATCH, max_rows + EXTRA_SCRATCH, *case.pool.shape[1:]), float("nan"),
                             device=device)
    o, final = fn(case.q.to(device, dtype), case.k.to(device, dtype), case.v.to(device, dtype), case.g.to(device),
                  case.beta.to(device), pool, case.cu_seqlens.to(device), max_rows,
                  state_index=case.state_index.to(device), row_states=scratch, **kwargs)
    name = str(dtype)[6:]
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert pool.isnan().equal(pool_before.isnan()) and pool.nan_to_num().equal(pool_before.nan_to_num()), \
        "the state pool changed"
    report.numeric(f"o/{name}", o, case.expected_o, NUMERIC_BOUND[dtype])
    report.numeric(f"final/{name}", final, case.expected_final, NUMERIC_BOUND[dtype])
    if capture:
        outside = torch.ones(scratch.shape[:2], dtype=torch.bool)
        outside[:batch, :max_rows] = False
        assert scratch.cpu()[outside].isnan().all(), "a scratch row outside [:B, :max_rows] was written"
        report.numeric(f"rows/{name}", scratch[:batch, :max_rows], case.expected_rows, NUMERIC_BOUND[dtype])


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


def test_gdn_recurrent_without_capture(impl_device, report):
    """Decode: no scratch, the final states only; and capture without the final states returns None."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    case = make_case([1, 1, 1], 2, 4, 16, 16, seed=3)
    check_gdn_recurrent(fn, case, device, torch.float32, report, capture=False)
    case = make_case([3, 2], 2, 4, 16, 16, seed=4)
    scratch = torch.zeros(2, 3, 4, 16, 16, device=device)
    _, final = fn(case.q.to(device), case.k.to(device), case.v.to(device), case.g.to(device), case.beta.to(device),
                  case.pool.to(device), case.cu_seqlens.to(device), 3, state_index=case.state_index.to(device),
                  row_states=scratch, output_final_state=False)
    assert final is None
    report.numeric("rows/float32", scratch, case.expected_rows, NUMERIC_BOUND[torch.float32])


@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [3, 1, 2]], ids=["decode", "ragged"])
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


def test_planted_bug_capture_one_row_late_is_caught(impl_device, report):
    """The state after row r written to scratch row r + 1 must fail."""
    impl, device = impl_device
    fn = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)

    def one_row_late(*args, row_states, **kwargs):
        return fn(*args, row_states=row_states[:, 1:], **kwargs)

    with pytest.raises(AssertionError):
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


def _decay_after_update_torch(q, k, v, g, beta, initial_state, cu_seqlens, max_rows, *, state_index, row_states):
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
            row_states[b, r] = s
        row_states[b, len(rows):max_rows] = s
        finals.append(s)
    return torch.stack(outputs), torch.stack(finals)


def test_planted_bug_decay_after_update_is_caught(report):
    with pytest.raises(AssertionError, match="rms-relative"):
        check_gdn_recurrent(_decay_after_update_torch, make_case([4, 2, 4], 2, 4, 16, 16, seed=8), "cpu",
                            torch.float32, report)
