"""fast/kernels/gdn/gdn_commit.py (the GDN verify commit, every layer in one launch: rollback by replay) vs
the commit's definition, sequence by sequence. The recurrent state: the kept rows 0 .. kept-1 replayed
from the slot's state (zeros for a zero-state sequence) by the reference's loop
(reference/model/delta_rule.gated_delta_rule_recurrent), NUMERIC fp32 (the replay runs in fp32
whatever the pool dtype). The conv state: the last K-1 columns of [pre-step state ; the conv inputs
of rows 0 .. kept-1], EXACT (bitwise, through integer views: NaN payloads and -0.0 included), for
the torch form and the Triton launcher alike; the launcher's conv equals the torch form's bit for
bit and its states the torch form's to NUMERIC. Every slot no sequence owns stays as it was, bit
for bit.

The replay is a run of the kept rows, EXACT: verify (the recurrence storing its rows' inputs,
fast/kernels/gdn/gdn_recurrent.py), then commit, equals bit for bit the final states of a decode-style
run of each sequence's first kept rows through the same recurrence from the same states (the torch
commit against the torch recurrence, the launcher against the Triton kernel: the same row update on
the same tiles). And the engine's CPU form: ``gdn.gated_delta_rule_torch`` storing the inputs, then
``speculative.commit.commit_verify``, equals that form run over the kept rows. conformance/layers/
test_fast_target_vs_reference.py holds the whole engine's verify-then-commit to the reference's replay.

Cases: B > 1 with distinct slots in no order, kept = 1 (the conv window still reaches into the
pre-step state) and kept = R, conv kernels 2 and 4 (K-1 = 1 and 3 taps, padded to 4), two layers,
GVA (Hv = 2 Hk), fp32 and bf16 pools, Dv over two state programs per head (the last partial) and
channel tiles that do not divide the sizes; a zero-state sequence (its slot holds NaN and must not
be read) and padding sequences (the trash slot). Poison: every scratch row other than the ones the
commit may read is NaN (rows kept and past, and the spare scratch sequences). Pools-level:
``speculative.commit.commit_verify`` dispatched to the kernel equals its torch path on a whole CachePools.
Planted bugs: the state one row late, and a zero-state sequence reading its slot, must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from dflash2.fast.kernels.gdn.gdn_commit import commit_verify_torch, commit_verify_triton, gdn_commit
from dflash2.fast.kernels.gdn.gdn_recurrent import (VerifyRowInputs, gated_delta_rule_verify_torch,
                                                gated_delta_rule_verify_triton)
from dflash2.fast.kernels.common.dispatch import GpuForm, forced_gpu, forced_torch
from dflash2.fast.model.batch import PAD_SLOT, ForwardBatch
from dflash2.fast.kernels.gdn.delta_rule import gated_delta_rule_torch
from dflash2.fast.model.pools import CachePools
from dflash2.fast.speculative.commit import commit_verify
from dflash2.fast.model.step import StepMeta
from dflash2.reference.model.delta_rule import gated_delta_rule_recurrent
from dflash2.reference.tiny.target import tiny_target_config
from ops_helpers import NUMERIC_BOUND, pick

NUM_SLOTS = 5  # the pools have NUM_SLOTS + 1 slots: the last is the trash slot
LAYERS = 2
ROWS = 5  # R, the verify scratch rows
SPARE = 1  # poisoned scratch sequences beyond B
HK, HV, DK, DV, CONV_DIM = 2, 4, 8, 20, 20
TILES = {"block_v": 16, "block_c": 8}  # 2 state programs per head (the last partial), 3 conv tiles
DTYPES = [torch.float32, torch.bfloat16]
FP32_BOUND = NUMERIC_BOUND[torch.float32]

# per sequence: (slot or PAD_SLOT, kept, starts from zeros)
SEQUENCES = {
    "mixed": [(3, 1, False), (0, ROWS, False), (2, 2, True), (PAD_SLOT, 3, True)],
    "two-padding": [(4, 3, False), (PAD_SLOT, 1, True), (1, ROWS, False), (PAD_SLOT, ROWS, True)],
    "one": [(1, 2, False)],
}


@dataclass
class Case:
    conv: torch.Tensor  # [L, S+1, Cd, K-1] pool dtype
    recurrent: torch.Tensor  # [L, S+1, Hv, Dk, Dv] fp32
    verify_conv: torch.Tensor  # [L, B + SPARE, R, Cd] pool dtype
    verify_rows: VerifyRowInputs  # [L, B + SPARE, R, ...]: k, g, beta fp32, v pool dtype
    state_index: torch.Tensor  # [B] long
    zero_state: torch.Tensor  # [B] bool
    kept: torch.Tensor  # [B] long

    def args(self, device: str) -> tuple:
        """Fresh copies on ``device``, in the commit's argument order (the commit writes the first two)."""
        copy = lambda t: t.to(device, copy=True)  # noqa: E731
        return (copy(self.conv), copy(self.recurrent), copy(self.verify_conv),
                VerifyRowInputs(*map(copy, self.verify_rows)), copy(self.state_index), copy(self.zero_state),
                copy(self.kept))


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal values with a sprinkling of -0.0 (a copy keeps its sign; a sum with 0.0 would not)."""
    x = torch.randn(*shape, generator=gen)
    return torch.where(torch.rand(*shape, generator=gen) < 0.1, -0.0, x)


def row_inputs(gen: torch.Generator, *lead: int) -> tuple[torch.Tensor, ...]:
    """Recurrence inputs as the layer makes them: k ``[*lead, Hk, Dk]`` L2-normalised, v ``[*lead, Hv, Dv]``,
    g ``[*lead, Hv]`` <= 0, beta in (0, 1)."""
    k = F.normalize(torch.randn(*lead, HK, DK, generator=gen), dim=-1)
    v = torch.randn(*lead, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(*lead, HV, generator=gen))
    return k, v, g, torch.sigmoid(torch.randn(*lead, HV, generator=gen))


def poisoned_rows(seqs: int, dtype: torch.dtype, layers: int = LAYERS) -> VerifyRowInputs:
    nan = float("nan")
    return VerifyRowInputs(torch.full((layers, seqs, ROWS, HK, DK), nan), torch.full((layers, seqs, ROWS, HV, DV), nan,
                                                                                  dtype=dtype),
                           torch.full((layers, seqs, ROWS, HV), nan), torch.full((layers, seqs, ROWS, HV), nan))


def make_case(sequences: list[tuple[int, int, bool]], kernel: int, dtype: torch.dtype, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch, taps = len(sequences), kernel - 1
    nan = float("nan")
    conv = torch.full((LAYERS, NUM_SLOTS + 1, CONV_DIM, taps), nan)
    recurrent = torch.full((LAYERS, NUM_SLOTS + 1, HV, DK, DV), nan)
    owned = {slot for slot, _, _ in sequences}
    for slot in range(NUM_SLOTS):
        if slot not in owned:  # no sequence's: must stay as it is
            conv[:, slot] = randn(gen, LAYERS, CONV_DIM, taps)
            recurrent[:, slot] = randn(gen, LAYERS, HV, DK, DV)
    verify_conv = torch.full((LAYERS, batch + SPARE, ROWS, CONV_DIM), nan)
    verify_rows = poisoned_rows(batch + SPARE, dtype)
    for b, (slot, kept, zero) in enumerate(sequences):
        if not zero:
            conv[:, slot] = randn(gen, LAYERS, CONV_DIM, taps)
            recurrent[:, slot] = randn(gen, LAYERS, HV, DK, DV)
        verify_conv[:, b, :kept] = randn(gen, LAYERS, kept, CONV_DIM)
        for scratch, x in zip(verify_rows, row_inputs(gen, LAYERS, kept)):
            scratch[:, b, :kept] = x.to(scratch.dtype)
    state_index = torch.tensor([NUM_SLOTS if slot < 0 else slot for slot, _, _ in sequences])
    zero_state = torch.tensor([zero for _, _, zero in sequences])
    kept = torch.tensor([kept for _, kept, _ in sequences])
    return Case(conv.to(dtype), recurrent, verify_conv.to(dtype), verify_rows, state_index, zero_state, kept)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality covers NaN payloads and the sign of zero."""
    return t.cpu().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def expected(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools after the commit, from its definition (the trash slot as the last padding sequence leaves it)."""
    conv, recurrent = case.conv.clone(), case.recurrent.clone()
    taps = conv.shape[-1]
    for b in range(case.kept.shape[0]):
        slot, kept = int(case.state_index[b]), int(case.kept[b])
        old = torch.zeros_like(case.conv[:, slot]) if case.zero_state[b] else case.conv[:, slot]  # [L, Cd, K-1]
        window = torch.cat([old, case.verify_conv[:, b, :kept].transpose(1, 2)], dim=2)  # [L, Cd, K-1+kept]
        conv[:, slot] = window[:, :, -taps:]
        for layer in range(LAYERS):
            k, v, g, beta = (t[layer, b, :kept] for t in case.verify_rows)
            k = k.repeat_interleave(HV // HK, dim=1)  # [kept, Hv, Dk]
            start = torch.zeros(HV, DK, DV) if case.zero_state[b] else case.recurrent[layer, slot]
            recurrent[layer, slot] = gated_delta_rule_recurrent(k, k, v, g, beta, start)[1]
    return conv, recurrent


def check(case: Case, conv: torch.Tensor, recurrent: torch.Tensor, trash: bool, report) -> None:
    """Against ``expected``: the conv EXACT, the states NUMERIC fp32, the slots nobody owns EXACT; the trash
    slot only where one padding sequence writes it (``trash``)."""
    want_conv, want_recurrent = expected(case)
    kept_slots = sorted({NUM_SLOTS if slot < 0 else slot for slot in case.state_index.tolist()})
    real = [s for s in kept_slots if s < NUM_SLOTS]
    for what, got, want in (("conv", conv, want_conv), ("recurrent", recurrent, want_recurrent)):
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}"
        assert not got.cpu()[:, real].isnan().any(), f"{what}: a poisoned value reached a committed slot"
        others = [s for s in range(NUM_SLOTS) if s not in kept_slots]
        assert torch.equal(bits(got)[:, others], bits(want)[:, others]), f"{what}: a slot nobody owns changed"
    compared = kept_slots if trash else real
    assert torch.equal(bits(conv)[:, compared], bits(want_conv)[:, compared]), "conv states differ"
    report.numeric("recurrent", recurrent[:, compared], want_recurrent[:, compared], FP32_BOUND)


@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_gdn_commit_matches_its_definition(impl_device, report, name, kernel):
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    kwargs = TILES if impl == "triton" else {}
    single_writer = sum(slot < 0 for slot, _, _ in SEQUENCES[name]) <= 1
    for dtype in DTYPES:
        case = make_case(SEQUENCES[name], kernel, dtype, seed=kernel * 10 + len(name))
        args = case.args(device)
        fn(*args, **kwargs)
        check(case, args[0], args[1], single_writer, report)
        for got, before in zip((args[2], *args[3]), (case.verify_conv, *case.verify_rows)):
            assert torch.equal(bits(got), bits(before)), "the commit changed the verify scratch"
        if impl == "triton":  # and the launcher is its torch form: the conv bit for bit, the states to rounding
            twin = case.args(device)
            commit_verify_torch(*twin)
            compared = slice(None) if single_writer else slice(0, NUM_SLOTS)
            assert torch.equal(bits(args[0])[:, compared], bits(twin[0])[:, compared])
            report.numeric("recurrent vs torch", args[1][:, compared].nan_to_num(), twin[1][:, compared].nan_to_num(),
                           FP32_BOUND)


def test_gdn_commit_default_tiles(impl_device, report):
    """The launcher's own tile sizes (one state program per head, one conv tile here) and int32 kept / state_index."""
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.bfloat16, seed=5)
    case.kept, case.state_index = case.kept.int(), case.state_index.int()
    args = case.args(device)
    fn(*args)
    check(case, args[0], args[1], True, report)


def verify_rows_of(case: Case, lens: list[int], seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, token-major verify inputs ``(q, k, v, g, beta)`` of ``lens[b]`` rows per sequence."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        k, v, g, beta = row_inputs(gen, sum(lens))
        q = F.normalize(torch.randn(sum(lens), HK, DK, generator=gen), dim=-1) * DK ** -0.5
        layers.append((q, k, v, g, beta))
    return layers


@pytest.mark.parametrize("block_v", [16, None], ids=["block16", "default-block"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixed", "two-padding"])
def test_verify_then_commit_is_a_run_of_the_kept_rows(impl_device, name, dtype, block_v):
    """EXACT: the recurrence over each sequence's verify rows storing their inputs (v in ``dtype``), then the
    commit, leaves in every real slot bit for bit the final state of the same recurrence run over the
    sequence's first kept rows alone from the same state: the state the verify reached after row kept-1.
    Sequences have rows past their kept ones (which the replay must skip); the verify leaves the pool alone.
    The Triton tiles: two state programs per head, or the launchers' default (one, Dv padded to 32)."""
    impl, device = impl_device
    recurrence = pick(impl, gated_delta_rule_verify_torch, gated_delta_rule_verify_triton)
    commit = pick(impl, commit_verify_torch, commit_verify_triton)
    kwargs = {"block_v": block_v} if impl == "triton" else {}  # the torch forms have no tiles: run twice
    case = make_case(SEQUENCES[name], 4, dtype, seed=31)
    kept = case.kept.tolist()
    lens = [min(ROWS, n + 1 + b % 2) for b, n in enumerate(kept)]
    readable = torch.where(case.zero_state, -1, case.state_index).to(device)
    conv, recurrent, verify_conv, verify_rows, state_index, zero_state, kept_t = case.args(device)
    verify_rows = VerifyRowInputs(*(torch.full_like(t, float("nan")) for t in verify_rows))
    pre_step = recurrent.clone()
    cu = torch.tensor([0] + lens).cumsum(0).to(device)
    inputs = verify_rows_of(case, lens, seed=32)
    for layer, rows in enumerate(inputs):
        q, k, v, g, beta = (t.to(device) for t in rows)
        recurrence(q, k, v.to(dtype), g, beta, recurrent[layer], cu, ROWS, state_index=readable,
                   verify_rows=VerifyRowInputs(*(t[layer] for t in verify_rows)), output_final_state=False, **kwargs)
    assert torch.equal(bits(recurrent), bits(pre_step)), "the verify wrote the state pool"
    commit(conv, recurrent, verify_conv, verify_rows, state_index, zero_state, kept_t, **kwargs)

    starts = torch.tensor([0] + lens).cumsum(0)[:-1]
    kept_rows = torch.cat([torch.arange(n) + start for n, start in zip(kept, starts)])  # token-major rows kept
    for layer, rows in enumerate(inputs):
        q, k, v, g, beta = (t[kept_rows].to(device) for t in rows)
        _, run = recurrence(q, k, v.to(dtype), g, beta, pre_step[layer].clone(),
                            torch.tensor([0] + kept).cumsum(0).to(device), max(kept), state_index=readable, **kwargs)
        for b, slot in enumerate(case.state_index.tolist()):
            if slot < NUM_SLOTS:  # the trash slot holds one of the padding sequences
                assert torch.equal(bits(recurrent[layer, slot]), bits(run[b])), \
                    f"layer {layer}, sequence {b}: the replayed state is not the run's"


def pools_and_batch(device: str, dtype: torch.dtype) -> tuple[CachePools, ForwardBatch, torch.Tensor]:
    """A poisoned CachePools of the tiny target, its verify scratch filled, and a verify batch of 3 rows per
    sequence: slots 2 and 0 continuing, slot 1 starting at position 0, a padding sequence."""
    cfg = tiny_target_config("tiny-dense")
    pools = CachePools(cfg, 2, 4, num_slots=3, max_verify_rows=4, dtype=dtype, device=device, max_verify_seqs=4,
                       poison=True)
    gen = torch.Generator().manual_seed(0)
    stack = pools.gdn_stack
    stack.verify_conv_inputs.copy_(torch.randn(stack.verify_conv_inputs.shape, generator=gen))
    k, v, g, beta = stack.verify_rows
    k.copy_(F.normalize(torch.randn(k.shape, generator=gen), dim=-1))
    v.copy_(torch.randn(v.shape, generator=gen))
    g.copy_(-F.softplus(torch.randn(g.shape, generator=gen)))
    beta.copy_(torch.sigmoid(torch.randn(beta.shape, generator=gen)))
    for slot in (2, 0):  # the continuing sequences' states; slot 1 (zero state) and the trash stay NaN
        stack.conv_storage[:, slot] = torch.randn(stack.conv_storage[:, slot].shape, generator=gen).to(dtype)
        stack.recurrent_storage[:, slot] = torch.randn(stack.recurrent_storage[:, slot].shape, generator=gen)
    return pools, batch_of(device, [3, 3, 3, 3]), torch.tensor([1, 3, 2, 2], device=device)


def batch_of(device: str, lens: list[int], is_verify: bool = True) -> ForwardBatch:
    """``lens[b]`` rows of sequences at slots 2, 0, 1 (from position 0) and a padding sequence."""
    starts = [9, 14, 0, 0]
    cu = torch.tensor([0] + lens).cumsum(0)
    return ForwardBatch(
        token_ids=torch.zeros(int(cu[-1]), dtype=torch.long, device=device),
        positions=torch.tensor([s + i for s, n in zip(starts, lens) for i in range(n)], device=device),
        cu_seqlens=cu.to(torch.int32).to(device), state_slots=torch.tensor([2, 0, 1, PAD_SLOT], device=device),
        kv_slot_mapping=torch.full((int(cu[-1]),), PAD_SLOT, device=device),
        block_tables=torch.full((4, 1), -1, dtype=torch.int32, device=device),
        context_lens=torch.zeros(4, dtype=torch.long, device=device), is_verify=is_verify,
        logits_rows=torch.arange(int(cu[-1]), device=device), max_query_len=max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pools_commit_verify_dispatched_to_the_kernel(monkeypatch, report, dtype):
    """``commit_verify`` on CUDA tensors equals its torch path on the same pools, every layer of the stack: the
    conv bit for bit, the states NUMERIC fp32 (without a GPU the CUDA dispatch is pretended and the
    interpreter runs the kernel on CPU tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_pools, batch, kept = pools_and_batch(device, dtype)
    kernel_pools, _, _ = pools_and_batch(device, dtype)
    with forced_torch([gdn_commit]):
        commit_verify(torch_pools, batch, kept)
    launched = []
    monkeypatch.setattr(gdn_commit, "gpu_forms",
                        (GpuForm(lambda *args: launched.append(1) or commit_verify_triton(*args)),))
    with forced_gpu([gdn_commit]):
        commit_verify(kernel_pools, batch, kept)
    assert launched == [1], "one launch for every layer"
    assert torch.equal(bits(torch_pools.gdn_stack.conv_storage), bits(kernel_pools.gdn_stack.conv_storage))
    report.numeric("recurrent", kernel_pools.gdn_stack.recurrent_storage[:, :3],
                   torch_pools.gdn_stack.recurrent_storage[:, :3], FP32_BOUND)
    for t in (kernel_pools.gdn_stack.conv_storage, kernel_pools.gdn_stack.recurrent_storage):
        assert not t[:, :3].isnan().any(), "a slot was left poisoned, or committed from a poisoned value"
    for i, slots in enumerate(kernel_pools.gdn.values()):  # the per-layer views see the committed states
        assert torch.equal(bits(slots.recurrent), bits(kernel_pools.gdn_stack.recurrent_storage[i, :3]))


def test_engine_torch_form_then_commit_is_a_run_of_the_kept_rows():
    """EXACT, the engine's CPU path: ``gdn.gated_delta_rule_torch`` on a verify step storing its rows' inputs into
    a layer's scratch, then ``speculative.commit.commit_verify``, leaves in each real slot bit for bit the final state of
    ``gated_delta_rule_torch`` run over the sequence's kept rows from the same state."""
    pools, verify_batch, kept = pools_and_batch("cpu", torch.float32)
    slots = next(iter(pools.gdn.values()))
    cfg = pools.cfg
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    gen = torch.Generator().manual_seed(3)
    rows = int(verify_batch.cu_seqlens[-1])
    q = F.normalize(torch.randn(rows, hk, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(rows, hk, dk, generator=gen), dim=-1)
    v, g = torch.randn(rows, hv, dv, generator=gen), -F.softplus(torch.randn(rows, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(rows, hv, generator=gen))
    meta = StepMeta.build(verify_batch, pools)
    start = slots.read_recurrent(meta.state_index, meta.zero_state)
    gated_delta_rule_torch(q, k, v, g, beta, start, meta, slots.verify_rows)
    commit_verify(pools, verify_batch, kept)

    kept_batch = batch_of("cpu", kept.tolist(), is_verify=False)
    kept_rows = torch.cat([torch.arange(n) + 3 * b for b, n in enumerate(kept.tolist())])
    _, run = gated_delta_rule_torch(q[kept_rows], k[kept_rows], v[kept_rows], g[kept_rows], beta[kept_rows], start,
                                    StepMeta.build(kept_batch, pools), None)
    for b, slot in enumerate((2, 0, 1)):
        assert torch.equal(bits(slots.recurrent[slot]), bits(run[b])), f"sequence {b}: not the run's state"


def test_planted_bug_state_one_row_late_is_caught(impl_device, report):
    """Replaying one row too many must fail on the states alone: the row past the kept ones holds plausible
    inputs here (a copy of row 0), not NaN."""
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=7)
    conv, recurrent, verify_conv, verify_rows, state_index, zero_state, kept = case.args(device)
    for b, n in enumerate(case.kept.tolist()):
        for scratch in verify_rows:
            scratch[:, b, n:] = scratch[:, b, :1]
    fn(conv, recurrent, verify_conv, verify_rows, state_index, zero_state, (kept + 1).clamp(max=ROWS))
    real = [s for s in case.state_index.tolist() if s < NUM_SLOTS]
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("recurrent", recurrent[:, real], expected(case)[1][:, real], FP32_BOUND)


def test_planted_bug_zero_state_read_is_caught(impl_device, report):
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=8)
    conv, recurrent, verify_conv, verify_rows, state_index, zero_state, kept = case.args(device)
    fn(conv, recurrent, verify_conv, verify_rows, state_index, torch.zeros_like(zero_state), kept)
    with pytest.raises(AssertionError, match="poisoned"):
        check(case, conv, recurrent, True, report)


def test_refusals():
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=9)
    conv, recurrent, verify_conv, verify_rows, state_index, zero_state, kept = case.args("cpu")
    with pytest.raises(ValueError, match="verify_conv_inputs"):
        commit_verify_triton(conv, recurrent, verify_conv[:, :2], verify_rows, state_index, zero_state, kept)
    with pytest.raises(ValueError, match="expected fp32"):
        commit_verify_triton(conv, recurrent.double(), verify_conv, verify_rows, state_index, zero_state, kept)
    with pytest.raises(ValueError, match="conv pool"):
        commit_verify_triton(conv, recurrent, verify_conv.bfloat16(), verify_rows, state_index, zero_state, kept)
    with pytest.raises(ValueError, match="dense"):
        commit_verify_triton(conv, recurrent.transpose(3, 4).contiguous().transpose(3, 4), verify_conv, verify_rows,
                             state_index, zero_state, kept)
    with pytest.raises(ValueError, match="verify_rows.g"):
        commit_verify_triton(conv, recurrent, verify_conv, verify_rows._replace(g=verify_rows.g[..., :1]), state_index,
                             zero_state, kept)
    with pytest.raises(ValueError, match="verify_rows.beta .*fp32"):
        commit_verify_torch(conv, recurrent, verify_conv, verify_rows._replace(beta=verify_rows.beta.double()),
                            state_index, zero_state, kept)
    with pytest.raises(ValueError, match="conv scratch"):
        commit_verify_torch(conv, recurrent, verify_conv, VerifyRowInputs(*(t[:, :, :2] for t in verify_rows)),
                            state_index, zero_state, kept)
    with pytest.raises(ValueError, match="contiguous"):
        commit_verify_triton(conv, recurrent, verify_conv, verify_rows._replace(v=verify_rows.v.transpose(3, 4)
                                                                                .contiguous().transpose(3, 4)),
                             state_index, zero_state, kept)
