"""fast/kernels/gdn_commit.py (the GDN verify commit, every layer in one launch) vs the commit's
definition, sequence by sequence: the kept row's recurrent state copied into the slot, and the conv
state = the last K-1 columns of [pre-step state (zeros for a zero-state sequence) ; the conv inputs
of rows 0 .. kept-1]. The reference has no such op (it rolls back by replaying the kept rows:
reference/speculative/loop.verify_step); conformance/layers/test_fast_target_vs_reference.py holds
the committed states to that replay. Both sides are copies, so everything here is EXACT (bitwise,
through integer views: NaN payloads and -0.0 included), for the torch form and the Triton launcher
alike, and the launcher equals the torch form bit for bit.

Cases: B > 1 with distinct slots in no order, kept = 1 (the window still reaches into the pre-step
state) and kept = R, conv kernels 2 and 4 (K-1 = 1 and 3 taps, padded to 4), two layers, fp32 and
bf16 conv pools, state and channel tiles that do not divide the sizes; a zero-state sequence (its
slot holds NaN and must not be read) and padding sequences (the trash slot). Poison: every verify
scratch row other than the ones the commit may read is NaN (recurrent: all rows but kept-1; conv
inputs: rows kept and past, and the spare scratch sequences), slots no sequence owns hold values
that must stay as they are. Pools-level: ``pools.commit_verify`` dispatched to the kernel equals its
torch path on a whole CachePools. Planted bugs: the state one row late, and a zero-state sequence
reading its slot, must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.fast.kernels.gdn_commit import commit_verify_torch, commit_verify_triton
from dflash2.fast.model import pools as pools_module
from dflash2.fast.model.batch import PAD_SLOT, ForwardBatch
from dflash2.fast.model.pools import CachePools, commit_verify
from dflash2.reference.tiny.target import tiny_target_config
from ops_helpers import pick

NUM_SLOTS = 5  # the pools have NUM_SLOTS + 1 slots: the last is the trash slot
LAYERS = 2
ROWS = 5  # R, the verify scratch rows
SPARE = 1  # poisoned scratch sequences beyond B
HV, DK, DV, CONV_DIM = 3, 4, 6, 20  # 72 fp32 per state, 20 conv channels
TILES = {"block": 32, "block_c": 8}  # 3 state tiles (the last partial), 3 conv tiles (the last partial)
DTYPES = [torch.float32, torch.bfloat16]

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
    verify_recurrent: torch.Tensor  # [L, B + SPARE, R, Hv, Dk, Dv] fp32
    state_index: torch.Tensor  # [B] long
    zero_state: torch.Tensor  # [B] bool
    kept: torch.Tensor  # [B] long

    def args(self, device: str) -> tuple[torch.Tensor, ...]:
        """Fresh copies on ``device``, in the commit's argument order (the commit writes the first two)."""
        return tuple(t.to(device, copy=True) for t in (self.conv, self.recurrent, self.verify_conv,
                                                       self.verify_recurrent, self.state_index, self.zero_state,
                                                       self.kept))


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal values with a sprinkling of -0.0 (a copy keeps its sign; a sum with 0.0 would not)."""
    x = torch.randn(*shape, generator=gen)
    return torch.where(torch.rand(*shape, generator=gen) < 0.1, -0.0, x)


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
    verify_recurrent = torch.full((LAYERS, batch + SPARE, ROWS, HV, DK, DV), nan)
    for b, (slot, kept, zero) in enumerate(sequences):
        if not zero:
            conv[:, slot] = randn(gen, LAYERS, CONV_DIM, taps)
        verify_conv[:, b, :kept] = randn(gen, LAYERS, kept, CONV_DIM)
        verify_recurrent[:, b, kept - 1] = randn(gen, LAYERS, HV, DK, DV)
    state_index = torch.tensor([NUM_SLOTS if slot < 0 else slot for slot, _, _ in sequences])
    zero_state = torch.tensor([zero for _, _, zero in sequences])
    kept = torch.tensor([kept for _, kept, _ in sequences])
    return Case(conv.to(dtype), recurrent, verify_conv.to(dtype), verify_recurrent, state_index, zero_state, kept)


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
        recurrent[:, slot] = case.verify_recurrent[:, b, kept - 1]
    return conv, recurrent


def check(case: Case, conv: torch.Tensor, recurrent: torch.Tensor, trash: bool) -> None:
    """EXACT against ``expected``; the trash slot only where one padding sequence writes it (``trash``)."""
    want_conv, want_recurrent = expected(case)
    kept_slots = [NUM_SLOTS if slot < 0 else slot for slot in case.state_index.tolist()]
    compared = slice(None) if trash else slice(0, NUM_SLOTS)
    for what, got, want in (("conv", conv, want_conv), ("recurrent", recurrent, want_recurrent)):
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}"
        written = got.cpu()[:, [s for s in kept_slots if s < NUM_SLOTS]]
        assert not written.isnan().any(), f"{what}: a poisoned value reached a committed slot"
        assert torch.equal(bits(got)[:, compared], bits(want)[:, compared]), f"{what} states differ"


@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_gdn_commit_matches_its_definition(impl_device, name, kernel):
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    kwargs = TILES if impl == "triton" else {}
    single_writer = sum(slot < 0 for slot, _, _ in SEQUENCES[name]) <= 1
    for dtype in DTYPES:
        case = make_case(SEQUENCES[name], kernel, dtype, seed=kernel * 10 + len(name))
        args = case.args(device)
        fn(*args, **kwargs)
        check(case, args[0], args[1], trash=single_writer)
        for i, before in ((2, case.verify_conv), (3, case.verify_recurrent)):
            assert torch.equal(bits(args[i]), bits(before)), "the commit changed the verify scratch"
        if impl == "triton":  # and the launcher is its torch form, bit for bit
            twin = case.args(device)
            commit_verify_torch(*twin)
            compared = slice(None) if single_writer else slice(0, NUM_SLOTS)
            for got, want in ((args[0], twin[0]), (args[1], twin[1])):
                assert torch.equal(bits(got)[:, compared], bits(want)[:, compared])


def test_gdn_commit_default_tiles(impl_device):
    """The launcher's own tile sizes (one state tile, one conv tile here) and int32 kept / state_index."""
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.bfloat16, seed=5)
    case.kept, case.state_index = case.kept.int(), case.state_index.int()
    args = case.args(device)
    fn(*args)
    check(case, args[0], args[1], trash=True)


def pools_and_batch(device: str, dtype: torch.dtype) -> tuple[CachePools, ForwardBatch, torch.Tensor]:
    """A poisoned CachePools of the tiny target, its verify scratch filled, and a verify batch of 3 rows per
    sequence: slots 2 and 0 continuing, slot 1 starting at position 0, a padding sequence."""
    cfg = tiny_target_config("tiny-dense")
    pools = CachePools(cfg, 2, 4, num_slots=3, max_verify_rows=4, dtype=dtype, device=device, max_verify_seqs=4,
                       poison=True)
    gen = torch.Generator().manual_seed(0)
    stack = pools.gdn_stack
    for t in (stack.verify_conv_inputs, stack.verify_recurrent):
        t.copy_(torch.randn(t.shape, generator=gen))
    for slot in (2, 0):  # the continuing sequences' conv states; slot 1 (zero state) and the trash stay NaN
        stack.conv_storage[:, slot] = torch.randn(stack.conv_storage[:, slot].shape, generator=gen).to(dtype)
    rows, starts = 3, [9, 14, 0, 0]
    batch = ForwardBatch(
        token_ids=torch.zeros(4 * rows, dtype=torch.long, device=device),
        positions=torch.tensor([s + i for s in starts for i in range(rows)], device=device),
        cu_seqlens=torch.arange(0, 4 * rows + 1, rows, dtype=torch.int32, device=device),
        state_slots=torch.tensor([2, 0, 1, PAD_SLOT], device=device),
        kv_slot_mapping=torch.full((4 * rows,), PAD_SLOT, device=device),
        block_tables=torch.full((4, 1), -1, dtype=torch.int32, device=device),
        context_lens=torch.zeros(4, dtype=torch.long, device=device), is_verify=True,
        logits_rows=torch.arange(4 * rows, device=device), max_query_len=rows)
    return pools, batch, torch.tensor([1, 3, 2, 2], device=device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pools_commit_verify_dispatched_to_the_kernel(monkeypatch, dtype):
    """``commit_verify`` on CUDA tensors equals its torch path on the same pools, every layer of the stack
    (without a GPU the CUDA dispatch is pretended and the interpreter runs the kernel on CPU tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_pools, batch, kept = pools_and_batch(device, dtype)
    kernel_pools, _, _ = pools_and_batch(device, dtype)
    monkeypatch.setattr(pools_module, "use_triton", lambda *tensors: False)
    commit_verify(torch_pools, batch, kept)
    launched = []
    monkeypatch.setattr(pools_module, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(pools_module, "commit_verify_triton",
                        lambda *args: launched.append(1) or commit_verify_triton(*args))
    commit_verify(kernel_pools, batch, kept)
    assert launched == [1], "one launch for every layer"
    for a, b in ((torch_pools.gdn_stack.conv_storage, kernel_pools.gdn_stack.conv_storage),
                 (torch_pools.gdn_stack.recurrent_storage, kernel_pools.gdn_stack.recurrent_storage)):
        assert torch.equal(bits(a), bits(b))
    for t in (kernel_pools.gdn_stack.conv_storage, kernel_pools.gdn_stack.recurrent_storage):
        assert not t[:, :3].isnan().any(), "a slot was left poisoned, or committed from a poisoned value"
    for i, slots in enumerate(kernel_pools.gdn.values()):  # the per-layer views see the committed states
        assert torch.equal(bits(slots.recurrent), bits(kernel_pools.gdn_stack.recurrent_storage[i, :3]))


def test_planted_bug_state_one_row_late_is_caught(impl_device):
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=7)
    conv, recurrent, *rest, kept = case.args(device)
    fn(conv, recurrent, *rest, (kept + 1).clamp(max=ROWS))
    with pytest.raises(AssertionError):
        check(case, conv, recurrent, trash=True)


def test_planted_bug_zero_state_read_is_caught(impl_device):
    impl, device = impl_device
    fn = pick(impl, commit_verify_torch, commit_verify_triton)
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=8)
    conv, recurrent, verify_conv, verify_recurrent, state_index, zero_state, kept = case.args(device)
    fn(conv, recurrent, verify_conv, verify_recurrent, state_index, torch.zeros_like(zero_state), kept)
    with pytest.raises(AssertionError, match="poisoned"):
        check(case, conv, recurrent, trash=True)


def test_refusals():
    case = make_case(SEQUENCES["mixed"], 4, torch.float32, seed=9)
    conv, recurrent, verify_conv, verify_recurrent, state_index, zero_state, kept = case.args("cpu")
    with pytest.raises(ValueError, match="verify_conv_inputs"):
        commit_verify_triton(conv, recurrent, verify_conv[:, :2], verify_recurrent, state_index, zero_state, kept)
    with pytest.raises(ValueError, match="expected fp32"):
        commit_verify_triton(conv, recurrent.double(), verify_conv, verify_recurrent, state_index, zero_state, kept)
    with pytest.raises(ValueError, match="conv pool"):
        commit_verify_triton(conv, recurrent, verify_conv.bfloat16(), verify_recurrent, state_index, zero_state,
                             kept)
    with pytest.raises(ValueError, match="dense"):
        commit_verify_triton(conv, recurrent.transpose(3, 4), verify_conv, verify_recurrent.transpose(4, 5),
                             state_index, zero_state, kept)
