"""fast/model/capture.py: graph_cut acts only inside ``cutting`` (a capture), which restores the outer cutter,
and the target marks a cut between each of its LAYER_GROUPS layer groups."""

from __future__ import annotations

import pytest

from dflash2.fast.model import capture
from dflash2.fast.model import target as target_module


def test_cutting_installs_and_restores_the_cutter():
    """Inside ``cutting`` a cut calls the cutter (the innermost); outside it, a cut calls nothing."""
    outer, inner = [], []
    with capture.cutting(lambda: outer.append(1)):
        capture.graph_cut()
        with capture.cutting(lambda: inner.append(1)):
            capture.graph_cut()
            capture.graph_cut()
        capture.graph_cut()
    capture.graph_cut()  # nothing installed any more: no call
    assert (outer, inner) == ([1, 1], [1, 1]) and capture._cut is None


def test_cutting_restores_after_an_error():
    with pytest.raises(RuntimeError):
        with capture.cutting(lambda: None):
            raise RuntimeError("capture failed")
    assert capture._cut is None


def test_the_target_cuts_between_layer_groups(tmp_path):
    """tiny-dense has 6 layers: LAYER_GROUPS = 4 groups of ceil(6/4) = 2 layers, so every forward marks
    cuts before layers 2 and 4 (the CPU runs eagerly; a cutter installed around it sees the marks)."""
    import torch

    from dflash2.fast.llm import LLM
    from dflash2.reference.tiny.target import write_tiny_target

    assert target_module.LAYER_GROUPS == 4
    llm = LLM(write_tiny_target(tmp_path / "target", "tiny-dense", tokenizer=None), dtype=torch.float32)
    target = llm.engine.model.target
    assert len(target.layers) == 6
    forwards, cuts = [], []
    forward = target.forward
    target.forward = lambda *a, **kw: forwards.append(1) or forward(*a, **kw)
    with capture.cutting(lambda: cuts.append(len(forwards))):
        llm.generate([[1, 2, 3]], None)
    assert forwards and cuts == [n for n in range(1, len(forwards) + 1) for _ in range(2)]
