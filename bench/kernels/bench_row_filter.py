"""GPU micro-benchmark: the sampled draw (``sample_triton``: the row filter, then the keyed draw) over a grid of
``FilterConfig`` launch shapes, to choose the default. Each config's tokens are checked against the default
config's on the same rows (any config gives the same tokens: EXACT) and timed by CUDA-graph replay (median).

Rows: the bundled target's own logits (``models/pycoder-10m``, V = 8256: the last 8 positions of each prompt of
``bench/prompts/python-8.json``, from the reference model on the CPU; their top-p 0.95 sets hold 0-600 tokens)
and the released vocabulary's (V = 248320, ``bench_verify.make_logits``: flat rows, every 5th peaked). Cases:
1, 8 and 64 rows (a plain decode of 1 and 8 requests, a k=7 verify of 8), T = 1 with top-p 0.95 alone and with
top-k 20 beside it.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_row_filter.py --out r.json          # on the GPU, ~1 min
    TRITON_INTERPRET=1 python3 bench/kernels/bench_row_filter.py --smoke                # CPU: the script's logic
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from dflash2.fast.kernels.sampling.row_filter import DEFAULT_CONFIG, FilterConfig
from dflash2.fast.kernels.sampling.sampler import SamplingTensors, sample_triton
from dflash2.reference.request.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "pycoder-10m" / "target"
PROMPTS = ROOT / "bench" / "prompts" / "python-8.json"

CONFIGS = [
    DEFAULT_CONFIG,
    FilterConfig(block_v=1024, blocks_per_chunk=1),
    FilterConfig(block_v=512, blocks_per_chunk=1),
    FilterConfig(block_v=256, blocks_per_chunk=1),
    FilterConfig(block_v=128, blocks_per_chunk=1),
    FilterConfig(block_v=256, blocks_per_chunk=1, thresholds=64),
    FilterConfig(block_v=256, blocks_per_chunk=1, rounds=8),
    FilterConfig(block_v=256, blocks_per_chunk=1, cap=512),
    FilterConfig(block_v=512, blocks_per_chunk=2),
]
FILTERS = {"top-p 0.95": dict(temperature=1.0, top_p=0.95), "top-k 20, top-p 0.95": dict(temperature=1.0, top_k=20,
                                                                                             top_p=0.95)}


def bundled_logits(rows_per_prompt: int = 8) -> torch.Tensor:
    """The bundled target's logits at the last positions of each prompt, bf16-rounded fp32  # [64, 8256]."""
    from dflash2.reference.formats.checkpoint import load_target
    from dflash2.reference.formats.tokenizer import load_tokenizer
    from dflash2.reference.model.target import ReferenceTarget

    cfg, weights = load_target(BUNDLED)
    model, tokenizer = ReferenceTarget(cfg, weights), load_tokenizer(BUNDLED)
    rows = []
    with torch.no_grad():
        for text in json.loads(PROMPTS.read_text())["prompts"]:
            ids = torch.tensor(tokenizer.encode(text)[:64])
            rows.append(model.forward(ids).logits[-rows_per_prompt:])
    return torch.cat(rows).to(torch.bfloat16).float()


def released_logits(rows: int, device: str) -> torch.Tensor:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_verify import V, make_logits

    return make_logits(rows, V, torch.Generator(device=device).manual_seed(0), device)


def draw(logits: torch.Tensor, params: dict, config: FilterConfig):
    rows = logits.shape[0]
    st = SamplingTensors.from_params([SamplingParams(seed=i, **params) for i in range(rows)], device=logits.device)
    positions = torch.arange(rows, device=logits.device) + 100
    return lambda: sample_triton(logits, st, positions, config=config)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): two configs, 1 row, no timing")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundled = bundled_logits().to(device)
    sets = {"V=8256 bundled": bundled}
    if not args.smoke:
        sets["V=248320 synthetic"] = released_logits(64, device)
    configs = CONFIGS[:2] if args.smoke else CONFIGS
    row_counts = [1] if args.smoke else [1, 8, 64]
    results = []
    for set_name, logits in sets.items():
        for rows in row_counts:
            for filter_name, params in FILTERS.items():
                x = logits[:rows].contiguous()
                expected = draw(x, params, DEFAULT_CONFIG)()
                case = {"logits": set_name, "rows": rows, "filter": filter_name, "configs": []}
                for config in configs:
                    fn = draw(x, params, config)
                    same = bool(torch.equal(fn(), expected))
                    us = None
                    if device == "cuda":
                        from dflash2.bench.measure import graph_seconds
                        us = 1e6 * graph_seconds(fn)
                    case["configs"].append({"config": asdict(config), "same_tokens": same, "us": us})
                    print(f"{set_name} rows={rows} {filter_name} {asdict(config)}: same={same} "
                          f"{'' if us is None else f'{us:.1f} us'}", flush=True)
                results.append(case)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                              "cases": results}, indent=1))
    return 0 if all(c["same_tokens"] for case in results for c in case["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
