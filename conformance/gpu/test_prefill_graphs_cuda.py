"""CUDA-graph replay of short prefill chunks (fast/engine/graphs/prefill_graphs.py) on the GPU lane.

TOKEN_STREAM: the engine with its prefill steps captured gives the tokens of the same engine with every prefill
step eager (``prefill_graph_rows`` 2048 against 0), off / MTP / DFlash, dense and MoE, fp32: prompts of different lengths on
3 slots (chunks padded to a row bucket, padding sequences beside them), then a second turn of each conversation
resumed from the prefix cache (its new rows alone prefilled, on a replay). Prefill steps were replayed (counted),
and the forward's layers run their CUDA forms there (the GDN recurrence in place, the paged-attention prefill
kernel), so a capture that read the host would have failed. A divergence is allowed only at a near tie of the
reference's logits (a padded batch's GEMMs may round differently from an unpadded one's).
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.runner import ReferenceRunner
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = write_tiny_target(root / "target", request.param, tokenizer=None)
    return request.param, target, write_tiny_draft(root / "draft", target)


def _near_tie(target_dir, prompt, a, b) -> bool:
    j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    logits = ReferenceRunner(target_dir).target.forward(torch.tensor(prompt + b[:j])).logits[-1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]) <= 1e-4


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_captured_prefill_gives_the_eager_prefills_tokens(stack, algorithm):
    name, target_dir, draft_dir = stack
    prompts = [[1, 2, 3], list(range(5, 30)), [9] * 7, list(range(40, 51)), [4, 4]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm=algorithm,
                  speculative_depth="fixed", snapshot_interval=16,
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None)
    graphed, eager = LLM(target_dir, prefill_graph_rows=2048, **kwargs), LLM(target_dir, prefill_graph_rows=0, **kwargs)
    graphs = graphed.engine.runner.prefill_graphs
    assert graphs is not None and eager.engine.runner.prefill_graphs is None
    for turn in range(2):
        fast, slow = graphed.generate(prompts, params), eager.generate(prompts, params)
        for prompt, a, b in zip(prompts, fast, slow):
            assert a.error is None and b.error is None
            assert a.token_ids == b.token_ids or _near_tie(target_dir, prompt, a.token_ids, b.token_ids), (
                f"{name} {algorithm} turn {turn + 1}: captured and eager prefills differ\n"
                f"graph {a.token_ids}\neager {b.token_ids}")
        prompts = [p + o.token_ids + [turn + 7] * 5 for p, o in zip(prompts, slow)]
    assert graphs.replays >= 2, f"{name} {algorithm}: no prefill step was replayed"
    assert all(len(step.graphs) > 1 for step in graphs.graphs.values()), "a capture was not cut into several graphs"
    assert graphed.engine.prefix_cache.stats.hits > 0, "no second turn hit the prefix cache"
