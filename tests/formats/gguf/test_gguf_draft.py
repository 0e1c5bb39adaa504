"""GGUF drafts written by llama.cpp's converter load to their safetensors source, config and tensors,
and draft the same block; a split set loads as one file."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from conftest import GOLDEN
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.formats.gguf_draft import _gguf_name, load_gguf_draft
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.model.target import ReferenceTarget

SPLIT = GOLDEN / "draft-f32-split" / "draft-f32-00001-of-00003.gguf"


def test_f32_draft_is_its_source(sources):
    target_cfg, target = load_target(sources / "tiny-dense")
    cfg, tensors = load_gguf_draft(GOLDEN / "draft-f32.gguf", target_cfg)
    source_cfg, source = load_draft(sources / "draft", target_cfg)
    assert cfg == source_cfg
    assert cfg.target_layer_ids == (0, 5)  # the file says [1, 6]: llama.cpp counts the next layer's input
    assert GGUFModel(GOLDEN / "draft-f32.gguf").metadata["dflash.target_layers"] == [1, 6]
    assert set(tensors) == set(source)
    for name, src in source.items():  # bf16 weights: exact in F32
        assert torch.equal(tensors[name], src), name

    # the same block from the same context
    tokens = torch.tensor([495, 3, 77, 150, 9, 320, 41, 12])
    taps = ReferenceTarget(target_cfg, target).forward(tokens).taps
    blocks = []
    for draft_cfg, weights in ((cfg, tensors), (source_cfg, source)):
        draft = ReferenceDraft(draft_cfg, weights, target)
        positions = torch.arange(len(tokens) - 1)
        k, v = draft.context_kv(draft.context_rows([t[:-1] for t in taps]), positions)
        blocks.append(draft.forward_block(int(tokens[-1]), len(tokens) - 1, positions, k, v).logits)
    assert torch.equal(blocks[0], blocks[1])


def test_q8_0_draft(sources):
    target_cfg, _ = load_target(sources / "tiny-dense")
    _, tensors = load_gguf_draft(GOLDEN / "draft-q8_0.gguf", target_cfg)
    _, source = load_draft(sources / "draft", target_cfg)
    model = GGUFModel(GOLDEN / "draft-q8_0.gguf")
    kinds = {"q8_0": 0, "f16": 0, "f32": 0}
    for name, src in source.items():
        gguf_name = _gguf_name(name)
        qtype = model.type_of(gguf_name)
        if qtype == Q.Q8_0:
            kinds["q8_0"] += 1
            assert np.array_equal(tensors[name].numpy(), dequantize(quantize(src.numpy(), Q.Q8_0), Q.Q8_0)), name
        elif qtype == Q.F16:
            kinds["f16"] += 1
            assert torch.equal(tensors[name], src.half().float()), name
        else:
            kinds["f32"] += 1
            assert qtype == Q.F32 and torch.equal(tensors[name], src), name
    assert kinds == {"q8_0": 2, "f16": 20, "f32": 14}


def test_split_draft_loads_as_one(sources):
    target_cfg, _ = load_target(sources / "tiny-dense")
    model = GGUFModel(SPLIT)
    assert len(model.files) == 3 and len(model.names()) == 36
    cfg, tensors = load_gguf_draft(SPLIT, target_cfg)
    whole_cfg, whole = load_gguf_draft(GOLDEN / "draft-f32.gguf", target_cfg)
    assert cfg == whole_cfg
    assert all(torch.equal(tensors[n], whole[n]) for n in whole) and set(tensors) == set(whole)
