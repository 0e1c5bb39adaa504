"""The tensor-parallel engine on CUDA (NCCL through fast/parallel/nccl.py, each rank's target forwards captured as
CUDA graphs) against tp=1 on CUDA: fp32 tiny targets, so only the order of the row-parallel sums differs and the
greedy tokens must be equal (EXACT), for plain decoding, MTP and DFlash, with the prefix cache on (a second turn
that hits it). Needs as many GPUs as ranks (skipped otherwise): the multi-GPU run of issue 36.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import PRESETS, write_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

WIDE_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [(7 * i + 3) % 200 for i in range(37)]]
CASES = [(algorithm, tp) for tp in (2, 4) for algorithm in ("none", "mtp", "dflash")]


@pytest.mark.parametrize("algorithm,tp", CASES)
def test_tp_on_cuda_gives_tp1_tokens(tmp_path, algorithm, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs, {torch.cuda.device_count()} visible")
    target = write_tiny_target(tmp_path / "target", replace(PRESETS["tiny-dense"], **WIDE_HEADS), tokenizer=None)
    draft = write_tiny_draft(tmp_path / "draft", target, seed=3)
    kw = dict(dtype=torch.float32, device="cuda", max_running_req=4, speculative_algorithm=algorithm,
              speculative_draft_model_path=str(draft) if algorithm == "dflash" else None, memory_ratio=0.3)

    def chat(llm: LLM):
        first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        second = llm.generate([PROMPTS[1] + first[1] + [5, 6]], GREEDY)[0]
        return first, second.token_ids, second.cached_tokens

    one = LLM(str(target), **kw)
    expected = chat(one)
    one.close()
    del one
    llm = LLM(str(target), tensor_parallel_size=tp, **kw)
    try:
        got = chat(llm)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs, "nothing was captured"
    finally:
        llm.close()
    assert got == expected
