"""A ``.gguf`` path runs wherever a checkpoint folder does: the reference runner and the fast engine read it through
the shared loaders (``checkpoint.load_target``, ``draft_checkpoint.load_draft``, ``tokenizer``), so an F32 GGUF
pair generates the safetensors pair's tokens (fp32, greedy, plain and DFlash), and its text through the file's own
tokenizer."""

from __future__ import annotations

import pytest

from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.formats.checkpoint import target_config
from dflash2.reference.formats.draft_checkpoint import draft_config
from dflash2.reference.formats.gguf_draft import load_gguf_draft
from dflash2.reference.formats.gguf_target import load_gguf_target
from dflash2.reference.runner import ReferenceRunner

from conftest import GOLDEN

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_an_f32_gguf_pair_generates_its_sources_tokens(sources, algorithm):
    draft = {"speculative_algorithm": algorithm}
    gguf_draft = dict(draft)
    if algorithm == "dflash":
        draft["speculative_draft_model_path"] = sources / "draft"
        gguf_draft["speculative_draft_model_path"] = GOLDEN / "draft-f32.gguf"
    expected = LLM(sources / "tiny-dense", device="cpu", dtype="float32", **draft).generate([PROMPT], GREEDY)[0]
    got = LLM(GOLDEN / "tiny-dense-f32.gguf", device="cpu", dtype="float32", **gguf_draft).generate([PROMPT], GREEDY)[0]
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 12
    ref = ReferenceRunner(GOLDEN / "tiny-dense-f32.gguf", speculative_algorithm=algorithm,
                          draft_model_path=gguf_draft.get("speculative_draft_model_path"))
    assert ref.generate(PROMPT, GREEDY).token_ids == expected.token_ids


def test_a_gguf_target_reads_its_own_tokenizer_and_stop_ids(sources):
    llm = LLM(GOLDEN / "tiny-moe-f32.gguf", device="cpu", dtype="float32")
    source = LLM(sources / "tiny-moe", device="cpu", dtype="float32")
    text = "def add(a, b):"
    assert llm.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert llm.engine.model.stop_token_ids == (497,)  # the file's eos (<|im_end|>), from its metadata


def test_configs_alone_and_dummy_weights_from_gguf_metadata():
    """target_config / draft_config read a GGUF file's metadata as the loaders do (ft bench's floors, a dummy
    load); --load-format dummy on a .gguf path draws weights at the file's shape."""
    target = GOLDEN / "tiny-dense-f32.gguf"
    draft = GOLDEN / "draft-f32.gguf"
    cfg = target_config(target)
    assert cfg == load_gguf_target(target)[0]
    assert draft_config(draft, cfg) == load_gguf_draft(draft, cfg)[0]
    llm = LLM(str(target), load_format="dummy", speculative_algorithm="dflash",
              speculative_draft_model_path=str(draft), dtype="float32", device="cpu")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 3
