"""The memory plan's profiling forward on the GPU lane (fast/engine/memory.py: forward_peak_bytes).

The activation peak the plan keeps out of the cache budget must cover what a real prefill of a full chunk then
reaches above the allocator's level: the profiling forward runs the same layers at the same row count, so the two
differ only by what the engine adds around a forward (the first token's sampling, the proposer's observe, which has
its own workspace). Checked with a 20% margin for those; a plan that measured nothing, or a smaller forward, fails.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.target import write_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_the_measured_activations_cover_a_full_prefill_chunk(name, tmp_path):
    target = write_tiny_target(tmp_path / name, name, tokenizer=None)
    chunk = 512
    llm = LLM(target, dtype=torch.bfloat16, device="cuda", max_running_req=2, max_num_batched_tokens=chunk,
              max_model_len=chunk + 8)
    plan = llm.engine.model.memory
    assert plan.activation_bytes > 0 and plan.graph_pool_bytes > 0
    device = torch.device("cuda")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    level = torch.cuda.memory_allocated(device)
    out = llm.generate([[(7 * i) % 100 + 1 for i in range(chunk)]], SamplingParams(max_tokens=1, temperature=0.0))
    torch.cuda.synchronize(device)
    reached = torch.cuda.max_memory_allocated(device) - level
    assert out[0].error is None
    assert reached <= 1.2 * plan.activation_bytes, (reached, plan.activation_bytes)
