"""CUDA-graph replay of the decode and verify forwards (fast/engine/graphs/graph_step.py) on the GPU lane.

1. EXACT: for every key shape, one replay equals an eager forward of the same padded batch bit for
   bit (logits, hidden, taps), and writes the same K/V and GDN state (the pools are cloned, one copy
   runs each path). Padding sequences leave every real slot untouched.
2. TOKEN_STREAM: requests through the engine with graphs (plain decode: the target forward;
   MTP and DFlash: the whole propose-verify-commit-observe step) give the tokens of the eager engine
   (``--enforce-eager``), dense and MoE, 5 requests of different lengths on 3 slots (so buckets pad),
   with graphs actually replayed (the graph count is asserted): all greedy, and mixed greedy and
   sampled (temperature, top-k, top-p, seeds; fp32, so a draw could only flip where its uniform
   lies within rounding of a CDF edge, about 1e-7 per token).
3. TOKEN_STREAM: DFlash steps that launch the next step's proposal ahead (``StepGraphs``, "Proposal
   ahead") give exactly the tokens of graph steps that do not, greedy and sampled, and steps did use a
   proposal launched ahead; steps that launch the whole next step (overlap scheduling) give exactly the tokens
   of the synchronous engine, MTP and DFlash.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import TargetGraphs
from dflash2.fast.engine.graphs.step_buffers import GraphKey, batch_view
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.runner import ReferenceRunner
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = write_tiny_target(root / "target", request.param, tokenizer=None)
    draft = write_tiny_draft(root / "draft", target)
    return request.param, target, draft


def _pools_state(pools) -> list[torch.Tensor]:
    """Every cache row a real sequence can read. The trash row and slot are left out: padding rows all
    write there, and which duplicate write lands last is not fixed."""
    tensors = [kv.keys for kv in pools.attention.values()] + [kv.values for kv in pools.attention.values()]
    for slots in pools.gdn.values():
        tensors += [slots.conv, slots.recurrent, slots.verify_conv_inputs[:3], *(t[:3] for t in slots.verify_rows)]
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_on_the_same_padded_batch(stack, dtype):
    name, target_dir, draft_dir = stack
    llm = LLM(target_dir, dtype=dtype, device="cuda", max_running_req=4, enforce_eager=True,  # scratch for 8 rows
              speculative_algorithm="dflash", speculative_draft_model_path=draft_dir, speculative_num_steps=7)
    target, pools = llm.engine.model.target, llm.engine.model.pools
    assert target.capturable(), f"{name}: the target's forward is not capturable (an op syncs with the host)"
    # write some context into slots 0..2 with an eager prefill so the step reads real state
    llm.generate([[5, 6, 7, 8, 9, 10, 11], [3, 4], [7] * 20], SamplingParams(max_tokens=3, temperature=0.0))
    graphs = TargetGraphs(target, pools, max_seqs=4, max_pages=8)
    gen = torch.Generator().manual_seed(0)
    for rows, is_verify in ((1, False), (8, True)):
        starts = torch.tensor([9, 4, 21])
        slots = torch.tensor([0, 1, 2])
        tables = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 4, 5]])
        key = graphs.key_for(3, rows, tables.shape[1], is_verify)
        assert key == GraphKey(4, rows, 8, is_verify)  # 3 sequences -> bucket 4, widths capped at max_pages
        tokens = torch.randint(0, target.cfg.vocab_size, (3 * rows,), generator=gen).cuda()
        logits_rows = torch.arange(3 * rows) if is_verify else torch.arange(3)

        before = [t.clone() for t in _pools_state(pools)]
        idle_slot = [s.recurrent_storage[3].clone() for s in pools.gdn.values()]  # slot 3 is not in the batch
        batch, out, _ = graphs.run(key, tokens, starts=starts, slots=slots, tables=tables, logits_rows=logits_rows)
        replayed = (out.logits.clone(), out.hidden.clone(), out.taps.clone())
        after_replay = [t.clone() for t in _pools_state(pools)]

        for t, saved in zip(_pools_state(pools), before):  # rewind the pools, then run the padded batch eagerly
            t.copy_(saved)
        step = graphs.graphs[key]
        assert len(step.graphs) > 1, "the capture was not cut between layer groups (fast/model/capture.py)"
        eager = target.forward(batch_view(step.inputs.device, key, step.inputs.device.tokens), pools)
        m, n = logits_rows.numel(), 3 * rows
        for what, a, b in (("logits", replayed[0], eager.logits[:m]), ("hidden", replayed[1], eager.hidden[:n]),
                           ("taps", replayed[2], eager.taps[:n])):
            assert torch.equal(a, b), f"{name} {dtype} rows={rows}: replayed {what} differ from eager"
        for i, (a, b) in enumerate(zip(after_replay, _pools_state(pools))):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name} {dtype} rows={rows}: cache tensor {i}"
        for saved, slots_pool in zip(idle_slot, pools.gdn.values()):  # padding sequences write the trash slot only
            assert torch.equal(saved.nan_to_num(), slots_pool.recurrent_storage[3].nan_to_num())


MIXED = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=4, ignore_eos=True),
         SamplingParams(max_tokens=9, temperature=1.0, top_k=20, top_p=0.95, seed=6, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)]


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_sampled_steps_replay_and_give_the_eager_engines_tokens(stack, algorithm):
    name, target_dir, draft_dir = stack
    prompts = [[1, 2, 3], list(range(5, 30)), [9] * 7, list(range(40, 51)), [4, 4]]
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm=algorithm,
                  speculative_depth="fixed",  # sampled tokens compared exactly: the same k every step
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None)
    graphed = LLM(target_dir, **kwargs)
    fast = graphed.generate(prompts, MIXED)
    runner = graphed.engine.runner  # plain decoding draws its tokens inside the decode graph
    keys = runner.graphs.graphs if algorithm == "none" else runner.step_graphs.graphs
    assert any(key.sampling.any_sampled for key in keys), f"{name} {algorithm}: no sampled step was replayed"
    eager = LLM(target_dir, enforce_eager=True, **kwargs).generate(prompts, MIXED)
    for prompt, a, b in zip(prompts, fast, eager):
        assert a.error is None and a.token_ids == b.token_ids, (f"{name} {algorithm}: graph and eager engines "
                                                                f"differ\ngraph {a.token_ids}\neager {b.token_ids}")


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_graph_engine_gives_the_eager_engines_tokens(stack, algorithm):
    name, target_dir, draft_dir = stack
    prompts = [[1, 2, 3], list(range(5, 30)), [9] * 7, list(range(40, 51)), [4, 4]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm=algorithm,
                  speculative_depth="fixed",  # sampled tokens compared exactly: the same k every step
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None)
    graphed = LLM(target_dir, **kwargs)
    fast = graphed.generate(prompts, params)
    runner = graphed.engine.runner
    replayed = runner.graphs.graphs if algorithm == "none" else runner.step_graphs.graphs
    assert replayed, f"{name} {algorithm}: no step was replayed from a CUDA graph"
    assert all(len(step.graphs) > 1 for step in replayed.values()), "a capture was not cut into several graphs"
    if algorithm == "dflash":  # steady steps found their early fields advanced on the device (StepGraphs)
        graphs = runner.step_graphs
        assert graphs.field_reuses + graphs.ahead.used + graphs.launched_ahead > 0, \
            f"{name}: no step reused its early fields"
    eager = LLM(target_dir, enforce_eager=True, **kwargs).generate(prompts, params)
    runner = None  # the reference, to judge a divergence
    for prompt, a, b in zip(prompts, fast, eager):
        if a.token_ids != b.token_ids:
            runner = runner or ReferenceRunner(target_dir)
            j = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            logits = runner.target.forward(torch.tensor(prompt + b.token_ids[:j])).logits[-1]
            top = torch.topk(logits, 2).values
            assert float(top[0] - top[1]) <= 1e-4, (f"{name} {algorithm}: graph and eager engines differ at token "
                                                     f"{j} without a near tie\ngraph {a.token_ids}\neager {b.token_ids}")


def test_proposals_launched_ahead_give_the_same_tokens(stack):
    """Three requests on three slots, nothing waiting, long enough for steady steps: with proposals ahead
    (the default) and without, bit for bit the same tokens (the same graphs: no rounding may differ);
    greedy and sampled in one batch. The eager engine's agreement is the tests above."""
    name, target_dir, draft_dir = stack
    prompts = [list(range(5, 30)), [9] * 7, [4, 4, 8]]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=1.0, top_k=5, seed=4, ignore_eos=True)]
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm="dflash",
                  speculative_draft_model_path=draft_dir, speculative_depth="fixed",
                  overlap_schedule=False)  # whole steps launched ahead would take the proposals' place
    outputs = {}
    for mode in ("ahead", "no ahead"):
        llm = LLM(target_dir, **kwargs)
        llm.engine.runner.step_graphs.ahead.enabled = mode == "ahead"
        outputs[mode] = [out.token_ids for out in llm.generate(prompts, params)]
        if mode == "ahead":
            graphs = llm.engine.runner.step_graphs
            assert graphs.ahead.used > 0, f"{name}: no step used a proposal launched ahead"
    assert outputs["ahead"] == outputs["no ahead"], f"{name}: proposals ahead changed the tokens"


@pytest.mark.parametrize("algorithm", ["mtp", "dflash"])
def test_overlap_scheduling_gives_the_synchronous_tokens(stack, algorithm):
    """Whole steps launched before the one before them is read (overlap scheduling, the default) against
    ``--disable-overlap-schedule``: bit for bit the same tokens (the same graphs), greedy and sampled in one batch,
    requests of different lengths (so the last steps verify fewer drafts on the same capture), and steps were
    launched ahead."""
    name, target_dir, draft_dir = stack
    prompts = [list(range(5, 30)), [9] * 7, [4, 4, 8]]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=41, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=45, temperature=1.0, top_k=5, seed=4, ignore_eos=True)]
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm=algorithm,
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None, speculative_depth="fixed")
    outputs = {}
    for overlap in (True, False):
        llm = LLM(target_dir, overlap_schedule=overlap, **kwargs)
        outputs[overlap] = [out.token_ids for out in llm.generate(prompts, params)]
        launched = llm.engine.runner.step_graphs.launched_ahead
        assert (launched > 0) == overlap, f"{name} {algorithm}: {launched} steps launched ahead"
    assert outputs[True] == outputs[False], f"{name} {algorithm}: overlap scheduling changed the tokens"


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_prefix_cache_hit_gives_the_cold_runs_tokens(stack, algorithm, enforce_eager):
    """The prefix cache on CUDA (fast/engine/prefix_cache.py), with and without graphs: a prompt resuming from a
    prefill snapshot, and a second turn resuming after the first one's finish, give a cold engine's tokens (the
    first draft block bit for bit is held on the CPU, conformance/tokens/test_tokens_prefix_cache.py: a trace
    turns the graphs off)."""
    name, target_dir, draft_dir = stack
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=3, speculative_algorithm=algorithm,
                  speculative_depth="fixed", snapshot_interval=16, enforce_eager=enforce_eager,
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = [(7 * i + 3) % 200 + 1 for i in range(40)]
    warm = LLM(target_dir, **kwargs)
    out = warm.generate([first], params)[0]
    boundary_hit = first[:35] + [9, 8, 7]
    turn_two = first + out.token_ids + [4, 4, 2]
    hits = [warm.generate([p], params)[0] for p in (boundary_hit, turn_two)]  # one at a time, as the cold runs
    assert [h.cached_tokens for h in hits] == [32, len(first) + len(out.token_ids) - 1]
    cold = [LLM(target_dir, **kwargs).generate([p], params)[0] for p in (boundary_hit, turn_two)]
    for h, c in zip(hits, cold):
        assert h.token_ids == c.token_ids, f"{name} {algorithm}: a hit and a cold run differ"


@pytest.mark.parametrize("algorithm", ["mtp", "dflash"])
def test_a_hit_after_2400_decoded_tokens(stack, algorithm):
    """A finish snapshot after 2,400 decoded tokens (rings and windows wrapped many times), CUDA graphs on: the
    next turn resumes after all of it and gives a cold engine's tokens."""
    name, target_dir, draft_dir = stack
    kwargs = dict(dtype=torch.float32, device="cuda", max_running_req=2, speculative_algorithm=algorithm,
                  speculative_depth="fixed", max_model_len=2600,
                  speculative_draft_model_path=draft_dir if algorithm == "dflash" else None)
    greedy = SamplingParams(max_tokens=2400, temperature=0.0, ignore_eos=True)
    warm = LLM(target_dir, **kwargs)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    out = warm.generate([first], greedy)[0]
    second = first + out.token_ids + [7, 7]
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hit = warm.generate([second], short)[0]
    assert hit.cached_tokens == len(first) + 2400 - 1
    assert hit.token_ids == LLM(target_dir, **kwargs).generate([second], short)[0].token_ids, f"{name} {algorithm}"
