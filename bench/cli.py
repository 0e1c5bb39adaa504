"""The ``ft bench`` command line (bench/run.py does the work)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash2.fast.engine.config import DUMMY_WEIGHT_TYPES, LOAD_FORMATS, SPECULATIVE_DEPTHS, SPEED_SWITCHES
from dflash2.reference.formats.errors import UserInputError
from dflash2.reference.request.sampling_params import SamplingParams

SEED = "seed"  # bench/simulated.py's SEED (not imported here: it pulls in torch, and parsing flags need not)

SETTING_NAMES = ("off", "mtp3", "mtp7", "dflash3", "dflash7")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _simulate(text: str) -> float | str:
    if text == SEED:
        return SEED
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected tokens per step (a number) or 'seed'") from None


def _settings(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in SETTING_NAMES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(SETTING_NAMES)}")
    return values


def _runs(text: str) -> list[tuple[str, int, int]]:
    runs = []
    for item in (v for v in text.split(",") if v):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in SETTING_NAMES or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
            raise argparse.ArgumentTypeError(f"{item!r}: expected setting:concurrency:prompt_len, e.g. dflash7:1:4096 "
                                             f"(settings {','.join(SETTING_NAMES)})")
        runs.append((parts[0], int(parts[1]), int(parts[2])))
    if not runs:
        raise argparse.ArgumentTypeError("--runs: expected at least one setting:concurrency:prompt_len")
    return runs


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time decoding and per-step costs beside their floors (code in bench/)")
    p.add_argument("--model", required=True, help="target folder (config.json; safetensors unless --load-format dummy)")
    p.add_argument("--draft", default=None, help="DFlash 2 draft folder (needed by the dflash settings)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights at the config's shape, built on the device (timing only)")
    p.add_argument("--dummy-weight-type", choices=DUMMY_WEIGHT_TYPES, default=None,
                   help="with --load-format dummy: the target's matrices as random GGUF blocks of this type, kept "
                        "quantized (timing a quantized target at a real shape)")
    p.add_argument("--settings", type=_settings, default=list(SETTING_NAMES), help="comma-separated (default: all)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="requests at once (default: 1,4,16)")
    p.add_argument("--prompt-lens", type=_int_list, default=[512, 4096], help="prompt tokens (default: 512,4096)")
    p.add_argument("--runs", type=_runs, default=None,
                   help="explicit runs setting:concurrency:prompt_len,... instead of the cross product of the three lists")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default: 128)")
    p.add_argument("--simulate-tokens-per-step", type=_simulate, default=None,
                   help="TIMING ONLY: verify keeps drafts so the mean committed tokens per step is this "
                        "(e.g. the seed's 5.47), or 'seed': each setting at the seed's own figure for the target's "
                        "family (MTP k=3/k=7 3.10/4.51 dense, 3.25/4.52 MoE; DFlash k=3/k=7 3.40/5.47, 3.52/5.39); "
                        "random weights accept nothing")
    p.add_argument("--out", default=None, help="results folder (default: bench/results/<date>-<gpu>)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--prefill-graph-rows", type=int, default=None,
                   help="EngineConfig.prefill_graph_rows: short prefill steps replayed as CUDA graphs up to this many "
                        "rows (default: EngineConfig's)")
    p.add_argument("--cpu-cache-bytes", type=int, default=None,
                   help="CPU: the cache budget (default: EngineConfig's); the DFlash ring of many requests needs more")
    p.add_argument("--prompts", default=None,
                   help="a JSON file {\"prompts\": [text, ...]} encoded by the model's tokenizer and cycled over each run's "
                        "requests (each cut to the run's prompt_len) instead of random ids: real acceptance")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy); with a seed per request, so a sampled run "
                        "draws the same tokens each time")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (default 1: off)")
    p.add_argument("--speculative-depth", choices=SPECULATIVE_DEPTHS, default="fixed",
                   help="fixed (the default here, unlike the engine's: a setting's step is its k's, and a timed run "
                        "meets the shapes its warm-up met): every step drafts the setting's k; adaptive: each step the "
                        "depth in 0..k with the most tokens per second (fast/speculative/depth.py), the report counting "
                        "the depths chosen")
    for switch in SPEED_SWITCHES:  # EngineConfig's speed switches, each on by default: --no-side-stream, ...
        p.add_argument(f"--{switch.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=True,
                       help=f"EngineConfig.{switch} (A/B timing; the tokens are the same either way)")
    p.add_argument("--memory-ratio", "--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the fraction of device memory weights and caches may use (default: EngineConfig's)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="EngineConfig.prefix_caching (its snapshot slots come out of the cache budget; each timed run "
                        "starts with an empty cache)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed generates per run (default 1): wall_s is their median, the step figures pool their "
                        "steps (a run of the bundled pair lasts tens of milliseconds, so one is noisy)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                   help="EngineConfig.tensor_parallel_size: the target sharded over this many ranks (gloo on the CPU, "
                        "NCCL on CUDA with rank r on cuda:r); the all-reduce bandwidth is measured first and each step's "
                        "floor is one rank's bytes plus its all-reduces (bench/floors.py; default 1)")
    p.add_argument("--profile", action="store_true", help="add each run's top kernels by GPU time (torch profiler)")
    p.set_defaults(func=run_bench)


def load_prompts(path: str) -> list[str]:
    """The texts of a ``--prompts`` file, refused with the field and what was expected."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserInputError(f"prompts={path!r}: expected a readable JSON file ({e})") from None
    texts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise UserInputError(f"prompts={path!r}: expected {{\"prompts\": [non-empty text, ...]}}")
    return texts


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from .run import SETTINGS, BenchArgs, main

    prompts = load_prompts(args.prompts) if args.prompts else None
    runs = args.runs or [(s, c, n) for n in args.prompt_lens for c in args.concurrency for s in args.settings]
    if any(SETTINGS[s][0] == "dflash" for s, _, _ in runs) and not args.draft:
        raise UserInputError(f"settings={','.join(sorted({s for s, _, _ in runs}))}: the dflash settings need --draft "
                             "(a DFlash 2 draft folder)")
    sim = args.simulate_tokens_per_step
    if sim is not None and sim != SEED and not 1.0 <= sim <= 8.0:
        raise UserInputError(f"simulate_tokens_per_step={sim}: expected 1 .. k+1 or 'seed'")
    if args.repeats < 1:
        raise UserInputError(f"repeats={args.repeats}: expected an integer >= 1")
    if args.max_tokens < 2:
        raise UserInputError(f"max_tokens={args.max_tokens}: expected an integer >= 2")
    tp = args.tensor_parallel_size
    if tp < 1:
        raise UserInputError(f"tensor_parallel_size={tp}: expected an integer >= 1 (--tp)")
    if torch.cuda.is_available() and tp > torch.cuda.device_count():
        raise UserInputError(f"tensor_parallel_size={tp}: expected at most the {torch.cuda.device_count()} visible "
                             "CUDA devices (rank r runs on cuda:r)")
    SamplingParams(temperature=args.temperature, top_p=args.top_p).validate()  # the field and value when refused
    gpu = torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"
    out = Path(args.out) if args.out else Path("bench/results") / f"{time.strftime('%Y-%m-%d')}-{gpu}"
    bench_args = BenchArgs(model=args.model, draft=args.draft, load_format=args.load_format, runs=runs,
                           max_tokens=args.max_tokens,
                           simulate_tokens_per_step=args.simulate_tokens_per_step, out_dir=out,
                           command="ft " + " ".join(sys.argv[1:]), profile=args.profile, prompts=prompts,
                           temperature=args.temperature, top_p=args.top_p, repeats=args.repeats, tp=tp,
                           extra={"enforce_eager": args.enforce_eager,
                                  "speculative_depth": args.speculative_depth,
                                  **({"cpu_cache_bytes": args.cpu_cache_bytes} if args.cpu_cache_bytes else {}),
                                  **({"memory_ratio": args.memory_ratio} if args.memory_ratio is not None else {}),
                                  "prefix_caching": args.prefix_caching,
                                  **({"prefill_graph_rows": args.prefill_graph_rows}
                                     if args.prefill_graph_rows is not None else {}),
                                  **({"dummy_weight_type": args.dummy_weight_type} if args.dummy_weight_type else {}),
                                  **{switch: getattr(args, switch) for switch in SPEED_SWITCHES}})
    return main(bench_args)
