"""fast/kernels/quant (GGUF weights kept as their bytes): the torch dequantization (``dequant_torch``) against
gguf-py's numpy ``gguf.quants.dequantize`` (the reference loader's), and the Triton dequantize kernel
(``dequant_triton``) against the torch twin, both EXACT (torch.equal) in fp32.

Inputs: random block bytes for every type (any byte pattern is a valid block once its fp16 scale fields are
finite: they are written explicitly, moderate normal halves of both signs), rows 3, 5 and 40, cols 256 and 512
for the 256-value types and 96 and 256 for Q8_0, the stacked-experts form [E, rows, cols] whole and expert by
expert. The Triton kernel in fp32 and fp16 (one rounding of the twin's fp32), bf16 on CUDA only (Triton 3.6's
interpreter converts to bf16 by truncation, not round-to-nearest-even: seen here). The layout against real
files: the golden llama.cpp GGUF files (Q8_0, F16, F32; BF16 stacked experts) and a GGUF written by gguf-py's
writer with every type, read back through the reference's GGUFModel. Planted bugs (a nibble order, a scale and
min swapped, a sign bit order, a sign lost, a table reversed) must fail the EXACT comparison. The IQ3_XXS sign
table the kernels read (``tables.iq3xxs_sign_words``) is held to gguf-py's ksigns for every index and codeword.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON
from dflash2.fast.kernels.quant import dequant_torch, dequant_triton, tables
from dflash2.fast.kernels.quant.dequant_torch import dequantize_torch
from dflash2.fast.kernels.quant.dequant_triton import dequantize_triton
from dflash2.fast.kernels.quant.layout import FLOAT_TYPES, QUANT_TYPES, Q, QuantWeight, block_shape, row_bytes
from dflash2.fast.kernels.quant.quant_linear import dequantize, dequantize_op
from dflash2.reference.formats.gguf_file import GGUFModel

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "formats" / "gguf" / "golden"

# byte offsets of each type's fp16 fields within its block (dequant_torch's docstring lays the blocks out)
HALF_FIELDS = {Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.IQ3_XXS: (0,)}
ROWS = (3, 5, 40)


def col_sizes(qtype) -> tuple[int, int]:
    return (96, 256) if qtype == Q.Q8_0 else (256, 512)


def random_bytes(qtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random GGUF row bytes ``[*shape[:-1], row_bytes]`` of ``qtype`` with every fp16 field a finite normal half,
    magnitude in [2^-12, 2^-4), either sign (so values stay moderate: at most ~63^2 2^-4 for the K types)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (*shape[:-1], row_bytes(qtype, shape[-1])), dtype=np.uint8)
    if qtype in QUANT_TYPES:
        blocks = raw.reshape(-1, block_shape(qtype)[1])
        for offset in HALF_FIELDS[qtype]:
            n = blocks.shape[0]
            half = rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-12, -4, n) * rng.choice([-1.0, 1.0], n)
            blocks[:, offset:offset + 2] = half.astype(np.float16).view(np.uint8).reshape(n, 2)
    else:  # float types: finite values
        values = rng.standard_normal(shape).astype(np.float32)
        raw = {Q.F32: values, Q.F16: values.astype(np.float16),
               Q.BF16: (values.view(np.uint32) >> 16).astype(np.uint16)}[qtype].view(np.uint8).reshape(raw.shape)
    return raw


def make_weight(qtype, shape: tuple[int, ...], seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    raw = random_bytes(qtype, shape, seed)
    return QuantWeight.from_bytes(raw, qtype, shape), raw


def gguf_values(raw: np.ndarray, qtype) -> torch.Tensor:
    """gguf-py's dequantization of the row bytes, fp32, in torch order."""
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype)).astype(np.float32, copy=False))


# where the Triton kernels run: CPU tensors under the interpreter (the root conftest sets it where no GPU is), CUDA
TRITON_DEVICES = ((["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON else [])
                  + (["cuda"] if torch.cuda.is_available() else []))


def assert_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.shape}"
    if not torch.equal(got, want):
        bad = (got != want) & ~(got.isnan() & want.isnan())
        raise AssertionError(f"{what}: {int(bad.sum())} of {want.numel()} values differ, first at "
                             f"{tuple(int(i) for i in bad.nonzero()[0])}: {got[bad][0].item()!r} vs {want[bad][0].item()!r}")


# -- the torch twin vs gguf-py ----------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QUANT_TYPES + tuple(FLOAT_TYPES), ids=lambda t: t.name)
def test_twin_equals_gguf_numpy(qtype):
    cols_list = col_sizes(qtype) if qtype in QUANT_TYPES else (48,)
    for rows in ROWS:
        for cols in cols_list:
            qw, raw = make_weight(qtype, (rows, cols), seed=rows * cols + int(qtype))
            got = dequantize_torch(qw)
            assert_exact(got, gguf_values(raw, qtype), f"{qtype.name} [{rows}, {cols}]")
            for dtype in (torch.float16, torch.bfloat16):
                assert_exact(dequantize_torch(qw, dtype), got.to(dtype), f"{qtype.name} -> {dtype}")


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_twin_stacked_experts(qtype):
    """[E, rows, cols]: whole, and expert by expert (``qw[e]``, a view of its bytes), equal to gguf-py's."""
    experts, rows, cols = 3, 5, col_sizes(qtype)[0]
    qw, raw = make_weight(qtype, (experts, rows, cols), seed=11)
    want = gguf_values(raw, qtype)
    assert qw.num_experts == experts and want.shape == (experts, rows, cols)
    assert_exact(dequantize_torch(qw), want, f"{qtype.name} stacked")
    for e in range(experts):
        assert qw[e].data.data_ptr() == qw.data[e].data_ptr()
        assert_exact(dequantize_torch(qw[e]), want[e], f"{qtype.name} expert {e}")
    assert QuantWeight.stack([qw[e] for e in range(experts)]).data.equal(qw.data)


# -- the Triton kernel vs the twin ---------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_equals_twin(device, qtype):
    """fp32 EXACT, fp16 EXACT (the twin's fp32 rounded once), bf16 on CUDA; into a NaN-poisoned ``out`` too, and
    the stacked form; row tiles of 16 and 32 (40 rows: a ragged last tile)."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for i, (rows, cols) in enumerate([(3, col_sizes(qtype)[1]), (5, col_sizes(qtype)[0]), (40, col_sizes(qtype)[1])]):
        qw = make_weight(qtype, (rows, cols), seed=100 + i)[0].to(device)
        want = dequantize_torch(qw)
        for dtype in dtypes:
            got = dequantize_triton(qw, dtype, block_r=16 if i % 2 else 32)
            assert_exact(got, want.to(dtype), f"{qtype.name} [{rows}, {cols}] {dtype}")
        out = torch.full(qw.shape, float("nan"), device=device)
        assert_exact(dequantize_triton(qw, out=out), want, f"{qtype.name} into out")
    stacked = make_weight(qtype, (2, 3, col_sizes(qtype)[0]), seed=7)[0].to(device)
    assert_exact(dequantize_triton(stacked), dequantize_torch(stacked), f"{qtype.name} stacked")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_dequantize_op_dispatch(device):
    """CPU calls take the twin, CUDA calls the kernel; under forced_gpu the kernel (its bits); float types the twin
    always."""
    qw = make_weight(Q.Q4_K, (3, 256), seed=1)[0]
    assert dequantize_op.pick(qw.data, qw, torch.float32) is dequantize_op.torch_form
    qw = qw.to(device)
    with forced_gpu([dequantize_op]):
        assert dequantize_op.pick(qw.data, qw, torch.float32) is not dequantize_op.torch_form
        assert_exact(dequantize(qw), dequantize_torch(qw), "forced_gpu")
        f16 = make_weight(Q.F16, (3, 8), seed=1)[0].to(device)
        assert dequantize_op.pick(f16.data, f16, torch.float32) is dequantize_op.torch_form


# -- the layout against real files ------------------------------------------------------------------

def from_reader_tensor(tensor) -> QuantWeight:
    """A GGUFReader tensor as the engine would hold it: its raw data, its type, GGUF's shape reversed."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return QuantWeight.from_bytes(np.asarray(tensor.data), tensor.tensor_type, shape)


@pytest.mark.parametrize("name", ["tiny-dense-q8_0.gguf", "tiny-moe-bf16-fused.gguf"])
def test_golden_files_match_the_reference_loader(name):
    """llama.cpp's converter's own files: every matrix (stacked experts included) dequantized from its bytes
    equals the reference's GGUFModel.tensor (gguf-py's numpy), in torch order."""
    path = GOLDEN / name
    model, reader = GGUFModel(path), GGUFReader(path)
    seen = set()
    for tensor in reader.tensors:
        if len(tensor.shape) < 2 or tensor.tensor_type not in QUANT_TYPES + tuple(FLOAT_TYPES):
            continue
        qw = from_reader_tensor(tensor)
        assert_exact(dequantize_torch(qw), model.tensor(tensor.name), tensor.name)
        seen.add((tensor.tensor_type.name, len(qw.shape)))
    want = {("Q8_0", 2)} if "q8_0" in name else {("BF16", 3)}
    assert want <= seen, f"{name}: expected {want} among {seen}"


def test_written_file_round_trip(tmp_path):
    """gguf-py's writer stores each type's random bytes; the reader's tensors, as QuantWeights, dequantize to
    the reference loader's values."""
    path = tmp_path / "quant.gguf"
    writer = GGUFWriter(path, "test")
    shapes = {}
    for i, qtype in enumerate(QUANT_TYPES):
        shape = (5, col_sizes(qtype)[1]) if i % 2 else (2, 3, col_sizes(qtype)[0])
        writer.add_tensor(f"w.{qtype.name}", random_bytes(qtype, shape, seed=i), raw_dtype=qtype)
        shapes[f"w.{qtype.name}"] = shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = GGUFModel(path)
    for tensor in GGUFReader(path).tensors:
        qw = from_reader_tensor(tensor)
        assert qw.shape == shapes[tensor.name]
        assert_exact(dequantize_torch(qw), model.tensor(tensor.name), tensor.name)


def test_from_bytes_refusals():
    raw = random_bytes(Q.Q4_K, (3, 256), seed=0)
    with pytest.raises(ValueError, match="expected 432"):
        QuantWeight.from_bytes(raw[:, :-1], Q.Q4_K, (3, 256))
    with pytest.raises(ValueError, match="multiple of its 256-value block"):
        QuantWeight.from_bytes(raw, Q.Q4_K, (3, 288))
    with pytest.raises(ValueError, match="expected one of"):
        QuantWeight.from_bytes(raw, Q.Q2_K, (3, 256))
    with pytest.raises(ValueError, match="expected contiguous uint8"):
        QuantWeight(torch.zeros(3, 400, dtype=torch.uint8), Q.Q4_K, (3, 256))
    read_only = raw.copy()
    read_only.flags.writeable = False  # a memory map: copied, no warning, same bytes
    assert QuantWeight.from_bytes(read_only, Q.Q4_K, (3, 256)).data.numpy().tobytes() == raw.tobytes()


# -- planted bugs -------------------------------------------------------------------------------------

def _wrong_nibble_order(qs):  # Q4_K/Q5_K: the high nibbles taken first
    n = qs.shape[0]
    q = dequant_torch._u(qs).reshape(n, 4, 1, 32) >> dequant_torch._shifts((4, 0), qs.device, (1, 1, 2, 1))
    return (q & 0x0F).reshape(n, 8, 32)


_REAL_SCALE_MIN = dequant_torch._scale_min_k4


def _scale_min_swapped(scales):  # Q4_K/Q5_K: the six-bit scales and mins exchanged
    sc, mn = _REAL_SCALE_MIN(scales)
    return mn, sc


PLANTS = {  # name: (type, the dequant_torch attribute replaced, its replacement)
    "q4_k_nibble_order": (Q.Q4_K, "_k_nibbles", _wrong_nibble_order),
    "q5_k_scale_min_swapped": (Q.Q5_K, "_scale_min_k4", _scale_min_swapped),
    "q8_0_unsigned": (Q.Q8_0, "_q8_0", lambda b: b[:, 2:].float() * dequant_torch._f16(b[:, :2])),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_twin_bugs_are_caught(plant, monkeypatch):
    qtype, attr, wrong = PLANTS[plant]
    qw, raw = make_weight(qtype, (5, col_sizes(qtype)[1]), seed=3)
    if attr == "_q8_0":
        monkeypatch.setitem(dequant_torch.DECODERS, Q.Q8_0, wrong)
    else:
        monkeypatch.setattr(dequant_torch, attr, wrong)
    with pytest.raises(AssertionError, match="values differ"):
        assert_exact(dequantize_torch(qw), gguf_values(raw, qtype), plant)


def reversed_sign_bits(real: tables.IQTables) -> tables.IQTables:
    """ksigns with each byte's bit order reversed (sign bit 0 read as bit 7, ...)."""
    shifts = torch.arange(8, device=real.ksigns.device)
    bits = (real.ksigns.to(torch.int32)[:, None] >> shifts) & 1
    return real._replace(ksigns=(bits.flip(1) << shifts).sum(1).to(torch.uint8))


def test_planted_twin_table_bug_is_caught(monkeypatch):
    """IQ3_XXS decoded with the sign bits read in reverse order."""
    qw, raw = make_weight(Q.IQ3_XXS, (5, 256), seed=5)
    real = tables.iq_tables(torch.device("cpu"))
    monkeypatch.setattr(dequant_torch, "iq_tables", lambda _: reversed_sign_bits(real))
    with pytest.raises(AssertionError, match="values differ"):
        assert_exact(dequantize_torch(qw), gguf_values(raw, Q.IQ3_XXS), "sign order")


def test_kernel_sign_formula_is_gguf_table():
    """The Triton decoder computes IQ3_XXS's sign byte as ``i | parity(i) << 7``: gguf-py's ksigns, entry by entry."""
    ksigns = tables.iq_tables(torch.device("cpu")).ksigns.tolist()
    assert ksigns == [i | (bin(i).count("1") % 2) << 7 for i in range(128)]


def test_sign_words_are_gguf_signs():
    """``tables.iq3xxs_sign_words``: for every sign index and every grid codeword, ``(G ^ N) + A`` of its half
    holds 64 + s m in each byte's low 7 bits, s gguf-py's ksigns bit (the kernels' offset-binary signed values)."""
    t = tables.iq_tables(torch.device("cpu"))
    words = t.iq3xxs_sign_words.to(torch.int64).reshape(128, 2, 2)  # [index, half, (N, A)]
    grid = t.iq3xxs_grid_packed.to(torch.int64) & 0xFFFFFFFF  # [256]
    mags = t.iq3xxs_grid.reshape(256, 4).to(torch.int64)
    for half in range(2):
        u = ((grid[None, :] ^ words[:, half, 0, None]) + words[:, half, 1, None]) & 0xFFFFFFFF  # [128, 256]
        got = (u[:, :, None] >> (8 * torch.arange(4))) & 0x7F  # [128, 256, 4]
        bits = (t.ksigns.to(torch.int64)[:, None] >> (4 * half + torch.arange(4))) & 1  # [128, 4]
        signs = 1 - 2 * bits
        assert torch.equal(got, 64 + signs[:, None, :] * mags[None, :, :])


@pytest.mark.parametrize("plant", ["grid_rows_rolled", "iq4_levels_reversed", "one_flipped_bit"])
@pytest.mark.parametrize("device", TRITON_DEVICES[:1])
def test_planted_kernel_bugs_are_caught(device, plant, monkeypatch):
    """The kernel fed a table with the IQ3_XXS codewords shifted by one or the IQ4 levels reversed, or one bit of
    one block's quants flipped: its output must differ from the twin's on the true bytes."""
    qtype = Q.IQ4_XS if plant == "iq4_levels_reversed" else Q.IQ3_XXS
    qw = make_weight(qtype, (5, 256), seed=4)[0].to(device)
    want = dequantize_torch(qw)
    if plant == "one_flipped_bit":
        data = qw.data.clone()
        data[2, 10] ^= 0x10  # a grid index of row 2's first block
        qw = QuantWeight(data, qw.qtype, qw.shape)
    else:
        real = tables.iq_tables(torch.device(device))
        if plant == "grid_rows_rolled":
            wrong = real._replace(iq3xxs_grid_packed=real.iq3xxs_grid_packed.roll(1))
        else:
            wrong = real._replace(iq4_kvalues=real.iq4_kvalues.flip(0))
        monkeypatch.setattr(dequant_triton, "iq_tables", lambda _: wrong)
    with pytest.raises(AssertionError, match="values differ"):
        assert_exact(dequantize_triton(qw), want, plant)
