"""fast/kernels/gdn/gdn_prefill.py (flash-linear-attention's chunked kernels) vs
reference/delta_rule.gated_delta_rule_recurrent: several sequences of different lengths (one row,
within a 64-row chunk, exactly one chunk, across chunk boundaries) flattened with ``cu_seqlens``,
GVA, starting states from a pool through ``state_index`` (NaN in the rows nobody reads; a negative
index starts from zeros). NUMERIC in bf16 (v in bf16, q and k fp32 as the layer hands them over)
on the outputs and the final states, against the reference on the fp32 inputs. CUDA with
flash-linear-attention only; the argument checks run everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import NUMERIC_BOUND

from dflash2.fast.kernels.gdn.gdn_prefill import fla_unavailable_reason, gated_delta_rule_prefill_fla
from dflash2.reference.model.delta_rule import gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu  # the CPU lane deselects it (scripts/test.sh); the GPU lane runs it
needs_fla = pytest.mark.skipif(fla_unavailable_reason() is not None,
                               reason=f"needs CUDA and flash-linear-attention (the GPU lane carries its wheels): "
                                      f"{fla_unavailable_reason()}")


def make_case(lens: list[int], key_heads: int, value_heads: int, key_dim: int, value_dim: int, seed: int,
              zero_start: tuple[int, ...] = (1,)):
    gen = torch.Generator().manual_seed(seed)
    rows, batch = sum(lens), len(lens)
    q = F.normalize(torch.randn(rows, key_heads, key_dim, generator=gen), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(rows, key_heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(rows, value_heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(rows, value_heads, generator=gen)) * torch.rand(rows, value_heads, generator=gen)
    beta = torch.sigmoid(torch.randn(rows, value_heads, generator=gen))
    pool = torch.full((batch + 2, value_heads, key_dim, value_dim), float("nan"))
    state_index = torch.randperm(batch + 2, generator=gen)[:batch]
    for b in range(batch):
        if b in zero_start:
            state_index[b] = -1
        else:
            pool[state_index[b]] = torch.randn(value_heads, key_dim, value_dim, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    ratio = value_heads // key_heads
    outputs, finals = [], []
    for b in range(batch):
        span = slice(int(cu[b]), int(cu[b + 1]))
        state = torch.zeros(value_heads, key_dim, value_dim) if state_index[b] < 0 else pool[state_index[b]]
        o, final = gated_delta_rule_recurrent(q[span].repeat_interleave(ratio, dim=1),
                                              k[span].repeat_interleave(ratio, dim=1), v[span], g[span], beta[span],
                                              state)
        outputs.append(o)
        finals.append(final)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu, state_index=state_index)
    return inputs, torch.cat(outputs), torch.stack(finals)


def check_prefill(inputs: dict, expected_o: torch.Tensor, expected_final: torch.Tensor, dtype: torch.dtype,
                  report) -> None:
    """Run the wrapper on CUDA with q, k fp32 and v in ``dtype`` (as the GDN layer hands them over) and
    hold its outputs and final states to the reference; the state pool must stay as it was."""
    args = {name: None if t is None else t.cuda() for name, t in inputs.items()}
    args["v"] = args["v"].to(dtype)
    pool_before = args["initial_state"].clone()
    o, final = gated_delta_rule_prefill_fla(**args)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert args["initial_state"].nan_to_num().equal(pool_before.nan_to_num()), "the state pool changed"
    name = str(dtype)[6:]
    report.numeric(f"o/{name}", o, expected_o, NUMERIC_BOUND[dtype])
    report.numeric(f"final/{name}", final, expected_final, NUMERIC_BOUND[dtype])


# Shapes are few on purpose: fla autotunes each kernel per (head counts, head dims, dtype) on first
# use, tens of compiles each. The tiny one is tiny-dense's, whose bf16 layer tests take this path too.
SHAPES = [  # sequence lengths, Hk, Hv, Dk, Dv
    ([1, 17, 64, 65, 130, 3], 2, 4, 128, 128),  # Qwen3.5's GDN head dims
    ([11, 5, 70, 1], 2, 4, 8, 12),  # the tiny targets' GDN shapes
]


@needs_fla
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s[0])}seqs-Hk{s[1]}-Hv{s[2]}-Dk{s[3]}-Dv{s[4]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_gdn_prefill_matches_reference(report, shape, dtype):
    lens, key_heads, value_heads, key_dim, value_dim = shape
    inputs, expected_o, expected_final = make_case(lens, key_heads, value_heads, key_dim, value_dim,
                                                   seed=len(lens) * 10 + key_dim)
    check_prefill(inputs, expected_o, expected_final, dtype, report)


@needs_fla
@pytest.mark.parametrize("rows", [130, 2048])
def test_one_sequence_without_a_sequence_table(report, rows):
    """One sequence, ``cu_seqlens`` None (what the GDN layer passes for a single-sequence chunk, so fla reads
    nothing on the host and the step can be captured): NUMERIC against the reference, as with the table."""
    inputs, expected_o, expected_final = make_case([rows], 2, 4, 128, 128, seed=rows, zero_start=())
    inputs["cu_seqlens"] = None
    check_prefill(inputs, expected_o, expected_final, torch.bfloat16, report)


@needs_fla
def test_planted_bug_wrong_starting_state_is_caught(report):
    """Each sequence reading the next sequence's starting state must fail. Short sequences keep their
    starting state visible in the final state; the long ones decay it away (their outputs still differ)."""
    inputs, expected_o, expected_final = make_case([1, 3, 17, 65], 2, 4, 8, 12, seed=1, zero_start=())
    inputs["state_index"] = inputs["state_index"].roll(1)
    with pytest.raises(AssertionError, match="rms-relative"):
        check_prefill(inputs, expected_o, expected_final, torch.bfloat16, report)


def test_gdn_prefill_refuses_fp32_and_cpu():
    """fp32 models take gdn_recurrent (fla's tf32 products miss the fp32 bound); fla runs on CUDA only."""
    inputs, _, _ = make_case([3, 2], 2, 4, 16, 16, seed=2)
    with pytest.raises(ValueError, match="bf16/fp16"):
        gated_delta_rule_prefill_fla(**inputs)
    inputs["v"] = inputs["v"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        gated_delta_rule_prefill_fla(**inputs)
