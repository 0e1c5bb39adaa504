"""fast/model/capture.py: graph_cut acts only inside ``cutting`` (a capture), which restores the outer cutter;
``layer_cuts`` puts short graphs first, then LAYER_GROUPS long ones, and the target marks those cuts."""

from __future__ import annotations

import pytest

from dflash2.fast.model import capture


def test_cutting_installs_and_restores_the_cutter():
    """Inside ``cutting`` a cut calls the cutter (the innermost); outside it, a cut calls nothing."""
    outer, inner = [], []
    with capture.cutting(lambda mark: outer.append(1)):
        capture.graph_cut()
        with capture.cutting(lambda mark: inner.append(1)):
            capture.graph_cut()
            capture.graph_cut()
        capture.graph_cut()
    capture.graph_cut()  # nothing installed any more: no call
    assert (outer, inner) == ([1, 1], [1, 1]) and capture._cut is None


def test_cutting_restores_after_an_error():
    with pytest.raises(RuntimeError):
        with capture.cutting(lambda mark: None):
            raise RuntimeError("capture failed")
    assert capture._cut is None


def test_layer_cuts_put_short_graphs_first():
    assert capture.LAYER_GROUPS == 4 and capture.EARLY_CUTS == (1, 3)
    assert capture.layer_cuts(40) == {1, 3, 10, 20, 30}  # the MoE shape: layers 0, 1-2, 3-9, then groups of 10
    assert capture.layer_cuts(64) == {1, 3, 16, 32, 48}  # the 27B
    assert capture.layer_cuts(8, groups=1) == {1, 3}  # a draft: the early cuts only
    assert capture.layer_cuts(6) == {1, 2, 3, 4} and capture.layer_cuts(2) == {1} and not capture.layer_cuts(1)


def test_the_target_marks_its_layer_cuts(tmp_path):
    """tiny-dense has 6 layers: every forward marks cuts before layers 1, 2, 3 and 4 (the CPU runs
    eagerly; a cutter installed around it sees the marks)."""
    import torch

    from dflash2.fast.llm import LLM
    from dflash2.reference.tiny.target import write_tiny_target

    llm = LLM(write_tiny_target(tmp_path / "target", "tiny-dense", tokenizer=None), dtype=torch.float32, device="cpu")
    target = llm.engine.model.target
    assert len(target.layers) == 6
    forwards, cuts = [], []
    forward = target.forward
    target.forward = lambda *a, **kw: forwards.append(1) or forward(*a, **kw)
    with capture.cutting(lambda mark: cuts.append(len(forwards))):
        llm.generate([[1, 2, 3]], None)
    assert forwards and cuts == [n for n in range(1, len(forwards) + 1) for _ in range(4)]
