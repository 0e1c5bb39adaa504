"""``ft bench``: end-to-end decoding through ``LLM.generate`` and per-step costs beside their floors.

For each setting (off, mtp k, dflash k), each concurrency and each prompt length, one engine is
built (``--load-format dummy`` builds any real shape from its config.json), warmed up with the
exact run it will time (so every CUDA graph is captured and every kernel compiled), then timed:

- decode / verify step: host wall time of each ``ModelRunner.decode`` / ``verify`` call, which
  ends on the step's one device-to-host read, so it includes the host's own work; median of the
  run's steps;
- draft forward: CUDA events around a CUDA-graph replay of the proposer's ``propose`` for the run's
  requests, as the step graph runs it (DFlash: the draft forward and the selector walk; MTP: the k
  chained head steps);
- sparse-q verify kernel: CUDA-graph replays of ``verify_ragged`` on random logits [B, k+1, V] with
  top-k 20, top-p 0.95, temperature 1 (the seed's 646 us figure: 4 requests, k = 7, graph replay);
- tokens/s: the tokens of all requests' decode or verify steps over those steps' wall time (the
  prefill, which yields each request's first token, is reported apart), and tokens per step;
- prefill: the summed wall time of the ``ModelRunner.prefill`` calls of the timed generate, the prefix cache
  emptied first so every prompt token is prefilled; each call runs chunks of at most max_num_batched_tokens rows in
  all (a longer prompt takes several calls) and is timed from a synchronized device to the end of its own device
  work (``StepClock``: a replayed chunk returns before its kernels run); prefill tokens/s: the rows those calls
  prefilled over that time.

Random weights accept no drafts. ``--simulate-tokens-per-step T`` (timing only, labelled in every
output) makes each verify keep drafts so the mean committed tokens per step is T (the seed's
measured 5.47 on 27B, 5.39 on 35B-A3B), so the end-to-end tokens/s of a trained pair at that
acceptance can be set beside plain decoding (bench/simulated.py wraps the engine's verifier; no serving path can).

Floors (bench/floors.py) are computed from the config and the copy bandwidth measured in the run (steps), or the
bf16 matmul rate measured in the run (the prefill: the target's FLOPs, CUDA only).

``--tp N`` (``tensor_parallel_size``): each engine shards the target over N ranks (this process rank 0, N - 1
spawned: fast/engine/tp/workers.py). Before the first engine, N spawned ranks time all-reduces at 16 MiB and at every
message size the runs' steps will all-reduce or all-gather (bench/allreduce.py); each step's floor is then one
rank's: its bytes over the copy bandwidth plus the step's collective bus bytes over the bus bandwidth measured at
their sizes (bench/floors.py), the two parts reported apart. Each engine is closed (its ranks stopped) before the next.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.warmup import warm_up
from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.fast.speculative.proposer import DraftProposal
from dflash2.fast.speculative.verify import verify_ragged
from dflash2.reference.formats.checkpoint import target_config
from dflash2.reference.formats.draft_checkpoint import draft_config

from .allreduce import PEAK_BYTES, AllReduceBandwidth, measure_allreduce
from .floors import dflash_draft_bytes, mtp_draft_bytes, prefill_flops, target_step_bytes, tp_collective_bytes
from .measure import copy_bandwidth, graph_seconds, matmul_rate
from .seed_figures import seed_kv_tokens
from .simulated import SimulatedAcceptance, SimulatedVerifier, tokens_per_step

SETTINGS = {"off": ("none", None), "mtp3": ("mtp", 3), "mtp7": ("mtp", 7), "dflash3": ("dflash", 3),
            "dflash7": ("dflash", 7)}


@dataclass
class BenchArgs:
    model: str
    draft: str | None
    load_format: str
    runs: list[tuple[str, int, int]]  # (setting, concurrency, prompt_len)
    max_tokens: int
    simulate_tokens_per_step: float | str | None  # a float, "seed" (each setting at the seed's own), or None
    out_dir: Path
    seed: int = 0
    command: str = ""
    profile: bool = False
    extra: dict = field(default_factory=dict)
    prompts: list[str] | None = None  # texts (through the model's tokenizer) in place of random ids, cycled
    temperature: float = 0.0  # every request's (request i seeded i)
    top_p: float = 1.0
    repeats: int = 1  # timed generates per run: wall figures are their median, step figures pool their steps
    tp: int = 1  # tensor_parallel_size: the target sharded over tp ranks, each step's floor one rank's


class StepClock:
    """Wraps a runner's step methods and records each call's host wall time (each ends on a device read).

    A speculative step's results come back from ``verify`` or, under overlap scheduling, from ``collect`` (the
    step launched ahead by the call before): each such call reads one step, so both count as verify steps, and
    the host time of a ``collect`` is the wait for the step it reads (the next one is already queued). A prefill
    call is timed from a synchronized device to the end of its own device work (a synchronize after it): a chunk
    that completes no prompt reads nothing back, and replayed as a captured graph (``--prefill-graph-rows``) it
    returns before its kernels have run, so its host time alone would leave them out. Each prefill call's chunks
    are kept as ``(start, length, completes_prompt)``, the rows it prefilled.
    """

    def __init__(self, runner, before_verify=None):
        self.runner, self.times = runner, {"decode": [], "verify": [], "prefill": []}
        self.before_verify = before_verify  # called before each verify step, outside its timing
        self.accepted: list[int] = []  # drafts kept, per request and verify step
        self.prefill_chunks: list[tuple[int, int, bool]] = []  # every prefill call's chunks, in order
        for kind in self.times:
            setattr(runner, kind, self._timed(kind, getattr(runner, kind)))
        runner.collect = self._timed("verify", runner.collect)

    def _timed(self, kind, fn):
        device = self.runner.device
        sync = (lambda: torch.cuda.synchronize(device)) if kind == "prefill" and device.type == "cuda" else None

        def call(*args, **kwargs):
            if kind == "verify" and self.before_verify is not None:
                self.before_verify()
            if sync is not None:
                sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if sync is not None:
                sync()
            self.times[kind].append(time.perf_counter() - start)
            if kind == "verify":
                self.accepted += [r.num_accepted for r in result]
            elif kind == "prefill":
                self.prefill_chunks += [(c.start, c.length, c.completes_prompt) for c in args[0].chunks]
            return result
        return call

    def reset(self):
        for values in self.times.values():
            values.clear()
        self.accepted.clear()
        self.prefill_chunks.clear()

    def acceptance_by_position(self, k: int) -> list[float]:
        """P(draft i accepted) for i = 1..k: the fraction of verify rows that kept at least i drafts."""
        n = max(len(self.accepted), 1)
        return [sum(a >= i for a in self.accepted) / n for i in range(1, k + 1)]


def verify_kernel_seconds(vocab: int, num_seqs: int, k: int, device: torch.device) -> float:
    """The sparse-q verify with target probabilities (top-k 20, top-p 0.95, T = 1) on random logits."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_seqs, k + 1, vocab, device=device, generator=gen) * 3
    drafts = torch.randint(0, vocab, (num_seqs, k), device=device, generator=gen)
    cand = torch.randint(0, vocab, (num_seqs, k, 16), device=device, generator=gen)
    cand[..., 0] = drafts
    probs = torch.softmax(torch.randn(num_seqs, k, 16, device=device, generator=gen), dim=-1)
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=i)
                                      for i in range(num_seqs)], device=device)
    anchors = torch.full((num_seqs,), 100, dtype=torch.long, device=device)
    proposal = DraftProposal(drafts, cand, probs)
    return graph_seconds(lambda: verify_ragged(logits, proposal, [k] * num_seqs, st, anchors))


def run_one(args: BenchArgs, setting: str, concurrency: int, prompt_len: int, bandwidth: float,
            matmul_flops: float | None, allreduce: AllReduceBandwidth | None = None) -> dict:
    """One engine, warmed up, then timed (module docstring), then closed (under tp > 1 its ranks stopped, even when
    the run fails, so the next engine can start its own). ``bandwidth``: copy bytes/s; ``matmul_flops``: the bf16
    matmul FLOP/s (None off CUDA: no prefill floor); ``allreduce``: the bus bandwidths ``--tp`` > 1 measured."""
    algorithm, k = SETTINGS[setting]
    llm = LLM(args.model, max_running_req=concurrency, load_format=args.load_format, seed=args.seed,
              speculative_algorithm=algorithm, speculative_num_steps=k,
              speculative_draft_model_path=args.draft if algorithm == "dflash" else None,
              max_model_len=prompt_len + args.max_tokens + 64, tensor_parallel_size=args.tp, **args.extra)
    try:
        return _timed_run(llm, args, setting, concurrency, prompt_len, bandwidth, matmul_flops, allreduce)
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _timed_run(llm: LLM, args: BenchArgs, setting: str, concurrency: int, prompt_len: int, bandwidth: float,
               matmul_flops: float | None, allreduce: AllReduceBandwidth | None) -> dict:
    algorithm, k = SETTINGS[setting]
    engine = llm.engine
    runner, model = engine.runner, engine.model
    simulated = None
    simulate = tokens_per_step(args.simulate_tokens_per_step, setting, model.target_cfg.is_moe)
    if simulate is not None:
        simulated = SimulatedVerifier(runner.spec.verifier, SimulatedAcceptance(simulate), runner.device)
        runner.spec.verifier = simulated
    clock = StepClock(runner, before_verify=simulated.next_step if simulated is not None else None)
    gen = torch.Generator().manual_seed(prompt_len * 1000 + concurrency)
    vocab = model.target_cfg.vocab_size
    if args.prompts:  # real text, so real weights accept what they would in use; prompt_len caps each prompt
        if llm.tokenizer is None:
            raise ValueError(f"prompts: {args.model} has no tokenizer to encode them")
        texts = [args.prompts[i % len(args.prompts)] for i in range(concurrency)]
        prompts = [llm.tokenizer.encode(text)[:prompt_len] for text in texts]
    else:
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(concurrency)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=i,
                             ignore_eos=True) for i in range(concurrency)]
    if engine.depth is not None and engine.depth.adaptive:
        warm_up(engine)  # every depth the policy may choose, at every batch bucket: none compiles in the timed run
        if simulated is not None:
            simulated.schedule.restart()  # the warm-up generate below keeps what the timed run will
    llm.generate(prompts, params)  # warm-up: the same shapes, so graphs and kernels are ready
    engine.clear_prefix_cache()  # the timed run prefills its prompts, as the warm-up did (no hits on its snapshots)
    if simulated is not None:
        simulated.schedule.restart()  # the same acceptance again, hence the same shapes
    clock.reset()
    chosen_before = dict(engine.depth.chosen) if engine.depth is not None and engine.depth.adaptive else None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    walls = []
    for repeat in range(args.repeats):
        if repeat:  # each timed generate starts as the first did: an empty cache, the same acceptance
            engine.clear_prefix_cache()
            if simulated is not None:
                simulated.schedule.restart()
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync()
        walls.append(time.perf_counter() - start)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{setting}: {errors[0]}")
    wall = statistics.median(walls)
    step_kind = "verify" if algorithm != "none" else "decode"
    step_times = clock.times[step_kind]
    prefill_s = sum(clock.times["prefill"])
    prefill_tokens = sum(length for _, length, _ in clock.prefill_chunks)
    decode_s = sum(step_times)
    # the first token of each request comes from its prefill; every repeat commits the same number of tokens
    tokens = args.repeats * (sum(len(o.token_ids) for o in outs) - concurrency)
    steps = len(step_times)
    cfg = model.target_cfg
    itemsize = torch.empty((), dtype=model.config.torch_dtype).element_size()
    context = prompt_len + args.max_tokens // 2
    rows = 1 + (k or 0)
    weight_type = args.extra.get("dummy_weight_type")  # GGUF blocks: the floor counts their bytes
    tp = engine.config.tensor_parallel_size
    # one rank's bytes (rank 0's: its shard, and the draft or MTP head whole, which it runs unsharded)
    floor_bytes = target_step_bytes(cfg, itemsize, num_seqs=concurrency, rows_per_seq=rows, context=context,
                                    weight_type=weight_type, tp=tp).total
    draft_params = 0
    if algorithm == "mtp":
        floor_bytes += mtp_draft_bytes(cfg, itemsize, num_seqs=concurrency, k=k, weight_type=weight_type)
    elif algorithm == "dflash":
        draft_cfg = draft_config(args.draft, cfg)
        floor_bytes += dflash_draft_bytes(draft_cfg, cfg, itemsize, weight_type)
        draft_params = sum(t.numel() for t in model.proposer.draft.w.values())
    collectives = tp_collective_bytes(cfg, itemsize, rows=concurrency * rows, logit_rows=concurrency * rows, tp=tp)
    if collectives.total and allreduce is None:
        raise RuntimeError(f"tp={tp}: the all-reduce bandwidth was not measured before the engine started")
    floor_collective_ms = 1e3 * collectives.seconds(allreduce.busbw if allreduce is not None else None)
    floor_bytes_ms = 1e3 * floor_bytes / bandwidth
    row = {
        "setting": setting, "algorithm": algorithm, "k": k, "concurrency": concurrency, "prompt_len": prompt_len,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "simulated_tokens_per_step": simulate,
        "step": step_kind, "steps": steps, "step_ms_median": 1e3 * statistics.median(step_times) if steps else None,
        "step_ms_mean": 1e3 * decode_s / steps if steps else None,
        "tp": tp, "floor_ms": floor_bytes_ms + floor_collective_ms, "floor_bytes_ms": floor_bytes_ms,
        "floor_allreduce_ms": floor_collective_ms, "floor_rank_bytes": floor_bytes,
        "allreduce_bus_bytes": collectives.all_reduce, "allgather_bus_bytes": collectives.all_gather,
        "allreduce_message_bytes": collectives.all_reduce_message,
        "allreduce_busbw_GBps": allreduce.busbw(collectives.all_reduce_message) / 1e9 if collectives.total else None,
        "tokens_per_s": tokens / decode_s if decode_s else None,
        "tokens_per_step": tokens / (steps * concurrency) if steps else None,
        "prefill_s": prefill_s / args.repeats, "wall_s": wall, "wall_s_runs": walls, "repeats": args.repeats,
        "wall_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "kv_tokens": model.memory.kv_tokens, "draft_params": draft_params,
        # what the budget holds before the cap of concurrency x max_model_len (the run's own prompts need far fewer),
        # beside the seed's engine at this shape on its card (bench/seed_figures.py; None elsewhere)
        "kv_tokens_budget": model.memory.budget_pages * model.memory.page_size,
        "seed_kv_tokens": seed_kv_tokens(cfg, setting, torch.cuda.get_device_properties(runner.device).total_memory
                                         if runner.device.type == "cuda" else None),
        "activation_bytes": model.memory.activation_bytes, "graph_pool_bytes": model.memory.graph_pool_bytes,
        "weights_GiB": model.load_bytes[0] / 2**30 if model.load_bytes else None,
        "load_peak_over_weights_GiB": (model.load_bytes[1] - model.load_bytes[0]) / 2**30 if model.load_bytes else None,
        "workspace_bytes": model.memory.workspace_bytes,
        "ring_bytes_per_slot": 0, "window_bytes_per_slot": 0, "graphs": runner.graphs is not None,
        "acceptance_by_position": clock.acceptance_by_position(k) if k else [],
    }
    row["floor_fraction"] = row["floor_ms"] / row["step_ms_median"] if steps else None
    # per timed generate, as prefill_s: the rows its prefill calls ran (every prompt token: the cache was emptied)
    flops = sum(prefill_flops(cfg, length, start=start, logits_rows=int(last))
                for start, length, last in clock.prefill_chunks) / args.repeats
    row.update(prefill_tokens=prefill_tokens // args.repeats, prefill_calls=len(clock.times["prefill"]) // args.repeats,
               max_num_batched_tokens=engine.config.max_num_batched_tokens, prefill_flops=flops,
               prefill_tokens_per_s=prefill_tokens / prefill_s if prefill_s else None,
               prefill_floor_s=flops / matmul_flops if matmul_flops else None)
    row["prefill_floor_fraction"] = (row["prefill_floor_s"] / row["prefill_s"]
                                     if row["prefill_floor_s"] is not None and prefill_s else None)
    if args.prompts:  # the texts' lengths, not prompt_len (their cap)
        row["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
    if chosen_before is not None:  # an adaptive depth: the steps of the timed run at each depth (the floor is k's)
        row["depths_chosen"] = {d: n - chosen_before[d] for d, n in engine.depth.chosen.items()}
    if algorithm == "dflash":
        from dflash2.fast.engine.memory import dflash_slot_bytes
        row["ring_bytes_per_slot"], row["window_bytes_per_slot"] = dflash_slot_bytes(draft_cfg, model.config.torch_dtype)
    if algorithm != "none" and torch.cuda.is_available():
        row["draft_ms"] = 1e3 * draft_seconds(engine, concurrency, prompt_len, k)
    if args.profile and torch.cuda.is_available():
        # 8-token prompts, so the 16-token generate is mostly decode or verify steps, not prefill
        row["profile"] = kernel_shares(llm, [p[:8] for p in prompts],
                                       [replace(p, max_tokens=17) for p in params])
    return row


def kernel_shares(llm, prompts, params, top: int = 15) -> dict:
    """Where a short generate's GPU time goes: the ``top`` kernels by total CUDA time, with their share
    (kernels replayed from CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {"total_gpu_ms": total / 1e3,
            "kernels": [{"name": e.key[:90], "calls": e.count, "gpu_ms": e.self_device_time_total / 1e3,
                         "share": e.self_device_time_total / total} for e in ranked]}


def draft_seconds(engine, concurrency: int, anchor: int, k: int) -> float:
    """One batched propose for ``concurrency`` requests at ``anchor`` (rings as the run left them), replayed
    from a CUDA graph as the engine's step graph runs it: CUDA-event median of the replays."""
    runner = engine.runner
    device = runner.device
    tokens = torch.ones(concurrency, dtype=torch.long, device=device)
    anchors = torch.full((concurrency,), anchor, dtype=torch.long, device=device)
    slots = torch.arange(concurrency, dtype=torch.long, device=device)
    page_size = engine.config.page_size
    width = (anchor + k + 1) // page_size + 1  # MTP writes its chain's K/V through these pages
    tables = torch.arange(concurrency * width, dtype=torch.int32, device=device).view(concurrency, width) \
        % engine.model.memory.num_pages
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * concurrency, device=device)

    return graph_seconds(lambda: runner.spec.proposer.propose(tokens, anchors, slots, tables, k, st))


def run(args: BenchArgs, on_row=None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    matmul_flops = matmul_rate(device) if device.type == "cuda" else None  # bf16, the dtype ft bench's targets run in
    cfg = target_config(args.model)
    allreduce = tp_bandwidth(args, cfg, device)
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "command": args.command, "model": args.model, "draft": args.draft,
        "load_format": args.load_format, "dummy_weight_type": args.extra.get("dummy_weight_type"),
        "copy_bandwidth_GBps": bandwidth / 1e9, "tp": args.tp,
        "allreduce": allreduce.to_json() if allreduce is not None else None,
        "bf16_matmul_TFLOPs": matmul_flops / 1e12 if matmul_flops else None,
        "shape": {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "vocab_size": cfg.vocab_size, "is_moe": cfg.is_moe},
        "git": _git_rev(), "simulated_tokens_per_step": args.simulate_tokens_per_step, "runs": [],
    }
    if device.type == "cuda":
        ks = sorted({SETTINGS[s][1] for s, _, _ in args.runs if SETTINGS[s][1]})
        result["verify_kernel_us"] = {f"B={b},k={k}": 1e6 * verify_kernel_seconds(cfg.vocab_size, b, k, device)
                                      for b in (1, 4, 16) for k in ks or [7]}
    for setting, concurrency, prompt_len in args.runs:
        try:
            row = run_one(args, setting, concurrency, prompt_len, bandwidth, matmul_flops, allreduce)
        except Exception as exc:  # one failed run is reported and the others still run
            row = {"setting": setting, "concurrency": concurrency, "prompt_len": prompt_len,
                   "error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
        if on_row is not None:
            on_row(result)
    return result


def tp_bandwidth(args: BenchArgs, cfg, device: torch.device) -> AllReduceBandwidth | None:
    """``--tp`` > 1: the all-reduce bus bandwidth of ``args.tp`` spawned ranks at 16 MiB and at each message size the
    runs' steps move (bench/floors.tp_collective_bytes: a step's all-reduce, its logits' all-gather), in the dtype
    the engines will run (EngineConfig's 'auto'); None at tp=1 (nothing to measure)."""
    if args.tp == 1:
        return None
    dtype = EngineConfig(model_path=args.model).resolved().torch_dtype  # LLM's dtype=None: bf16 on CUDA, fp32 on CPU
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {PEAK_BYTES}
    for setting, concurrency, _ in args.runs:
        rows = concurrency * (1 + (SETTINGS[setting][1] or 0))
        c = tp_collective_bytes(cfg, itemsize, rows=rows, logit_rows=rows, tp=args.tp)
        sizes |= {c.all_reduce_message, c.all_gather_message}
    return measure_allreduce(args.tp, device.type, sizes, dtype)


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def main(args: BenchArgs) -> int:
    from .report import write_report

    result = run(args, on_row=lambda partial: write_report(partial, args.out_dir, quiet=True))
    write_report(result, args.out_dir)
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: ft bench ...")
