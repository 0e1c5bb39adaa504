"""What a GGUF loader refuses at startup, each naming the file, the key or tensor, and what was expected.

The broken files are golden files rewritten with gguf-py's writer, changed in one thing only.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import GOLDEN, rewrite
from dflash2.reference.formats.errors import CheckpointError, ConfigError
from dflash2.reference.formats.gguf_draft import load_gguf_draft
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.formats.gguf_target import load_gguf_target

DENSE = GOLDEN / "tiny-dense-f32.gguf"
DRAFT = GOLDEN / "draft-f32.gguf"


def test_unchanged_rewrite_still_loads(tmp_path):
    """The rewriting helper alone changes nothing a loader sees (so the refusals below are the edits')."""
    cfg, tensors = load_gguf_target(rewrite(DENSE, tmp_path / "same.gguf"))
    golden_cfg, golden = load_gguf_target(DENSE)
    assert cfg == golden_cfg and all(torch.equal(tensors[n], golden[n]) for n in golden)


def test_unknown_arch(tmp_path):
    path = rewrite(DENSE, tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ConfigError, match=r"llama\.gguf: general\.architecture='llama': expected a target of one of "
                                          r"\['qwen35', 'qwen35moe'\]"):
        load_gguf_target(path)
    with pytest.raises(ConfigError, match=r"general\.architecture='qwen35': expected a DFlash draft, 'dflash'"):
        load_gguf_draft(DENSE, load_gguf_target(DENSE)[0])


def test_missing_tensor(tmp_path):
    path = rewrite(DENSE, tmp_path / "no-gate.gguf", drop_tensors=("blk.3.attn_gate.weight",))
    with pytest.raises(CheckpointError, match=r"no-gate\.gguf: missing tensor 'blk\.3\.attn_gate\.weight' "
                                              r"\(canonical 'layers\.3\.linear_attn\.in_proj_z\.weight'\)"):
        load_gguf_target(path)
    path = rewrite(DENSE, tmp_path / "no-mtp-norm.gguf", drop_tensors=("blk.6.nextn.enorm.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.6\.nextn\.enorm\.weight' "
                                              r"\(canonical 'mtp\.pre_fc_norm_embedding\.weight'\)"):
        load_gguf_target(path)
    target_cfg = load_gguf_target(DENSE)[0]
    path = rewrite(DRAFT, tmp_path / "no-selector.gguf", drop_tensors=("selector_successor.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'selector_successor\.weight' \(canonical "
                                              r"'candidate_selector\.successor_codebook'\) in the draft"):
        load_gguf_draft(path, target_cfg)


def test_unexpected_tensor(tmp_path):
    target_cfg = load_gguf_target(DENSE)[0]
    path = rewrite(DRAFT, tmp_path / "embd.gguf", add_tensors={"token_embd.weight": np.zeros((512, 40))})
    with pytest.raises(CheckpointError, match=r"embd\.gguf: unexpected tensor 'token_embd\.weight': not part of a "
                                              r"DFlash 2 draft"):
        load_gguf_draft(path, target_cfg)
    path = rewrite(DENSE, tmp_path / "mtp-less.gguf", drop_keys=("qwen35.nextn_predict_layers",))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'blk\.6\.nextn\.eh_proj\.weight', .*not part of "
                                              r"a 'qwen35' target with this metadata"):
        load_gguf_target(path)


def test_unsupported_type(tmp_path):
    path = rewrite(DENSE, tmp_path / "q4_0.gguf", requantize={"blk.2.attn_output.weight": Q.Q4_0})
    assert GGUFModel(path).type_of("blk.2.attn_output.weight") == Q.Q4_0
    with pytest.raises(CheckpointError, match=r"q4_0\.gguf: tensor 'blk\.2\.attn_output\.weight' is stored as Q4_0; "
                                              r"expected one of F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS"):
        load_gguf_target(path)


def test_missing_metadata_key(tmp_path):
    path = rewrite(DENSE, tmp_path / "no-groups.gguf", drop_keys=("qwen35.ssm.group_count",))
    with pytest.raises(ConfigError, match=r"no-groups\.gguf: metadata key 'qwen35\.ssm\.group_count' is missing; "
                                          r"expected an integer"):
        load_gguf_target(path)


def test_draft_without_window(tmp_path):
    target_cfg = load_gguf_target(DENSE)[0]
    path = rewrite(DRAFT, tmp_path / "no-window.gguf",
                   drop_keys=("dflash.attention.sliding_window", "dflash.attention.sliding_window_pattern"))
    with pytest.raises(ConfigError, match=r"'dflash\.attention\.sliding_window' is missing; expected the DFlash 2 "
                                          r"sliding window"):
        load_gguf_draft(path, target_cfg)
    causal = rewrite(DRAFT, tmp_path / "causal.gguf", drop_keys=("dflash.attention.causal",))
    with pytest.raises(ConfigError, match=r"is_causal=None: expected false"):
        load_gguf_draft(causal, target_cfg)


def test_split_set_refusals(tmp_path):
    for shard in (GOLDEN / "draft-f32-split").iterdir():
        shutil.copy(shard, tmp_path / shard.name)
    second = tmp_path / "draft-f32-00002-of-00003.gguf"
    with pytest.raises(CheckpointError, match=r"shard 2 of a split GGUF; expected the first shard's path "
                                              r"\(draft-f32-00001-of-00003\.gguf\)"):
        GGUFModel(second)
    (tmp_path / "draft-f32-00003-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match=r"split GGUF of 3 shards, but draft-f32-00003-of-00003\.gguf is missing"):
        GGUFModel(tmp_path / "draft-f32-00001-of-00003.gguf")

