"""Engine benchmark: plain decoding, MTP and DFlash through ``LLM.generate`` on one random mid-size target.

The weights are random (no trained checkpoint can be downloaded here), so drafts are almost never
accepted: tokens per step stays near 1 and speculative runs are slower than plain decoding. What
this measures is the engine's own cost, side by side in one run: milliseconds per decode step vs
per verify step (k drafts proposed and verified), prefill time, and memory sizing. Speedups over
plain decoding need trained drafts and are not claimed from these numbers.

    python bench/bench_engine.py --out bench.json     # runs every setting, writes JSON
    python bench/bench_engine.py --summarize bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import TinyTargetSpec, write_tiny_target

SHAPE = dict(kind="dense", vocab_size=32000, hidden_size=2048, num_layers=8, full_attention_interval=4,
             num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
             intermediate_size=6144, mtp=True, dtype="bfloat16")
SMOKE = dict(SHAPE, vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             intermediate_size=128)
SETTINGS = [("off", None, None), ("mtp", "mtp", 3), ("dflash", "dflash", 7)]
PROMPT_LEN, MAX_TOKENS = 256, 128


def run(out_path: str, shape: dict) -> None:
    root = Path(tempfile.mkdtemp(prefix="dflash2_bench_"))
    spec = TinyTargetSpec(**shape)
    target = write_tiny_target(root / "target", spec, tokenizer=None)
    draft = write_tiny_draft(root / "draft", target, num_layers=2)
    gen = torch.Generator().manual_seed(0)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
               else "cpu", "torch": torch.__version__, "shape": shape, "prompt_len": PROMPT_LEN,
               "max_tokens": MAX_TOKENS, "command": " ".join(sys.argv), "runs": []}
    for batch in (1, 4):
        prompts = [torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for name, algorithm, k in SETTINGS:
            llm = LLM(target, max_running_req=batch, speculative_algorithm=algorithm, speculative_num_steps=k,
                      speculative_draft_model_path=draft if algorithm == "dflash" else None)
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm up
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            steps = max(max(o.verify_steps for o in outs), 1) if algorithm else MAX_TOKENS
            decode_s = max(o.timing.get("decode_s", 0.0) for o in outs)
            row = {"setting": name, "k": k, "batch": batch, "wall_s": wall, "output_tokens": tokens,
                   "tokens_per_s": tokens / wall, "steps": steps,
                   "tokens_per_step": sum(o.tokens_per_step for o in outs) / len(outs) if algorithm else 1.0,
                   "ms_per_step": 1000 * decode_s / steps,
                   "prefill_s": max(o.timing.get("prefill_s", 0.0) for o in outs)}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    Path(out_path).write_text(json.dumps(results, indent=1))


def summarize(path: str) -> None:
    data = json.loads(Path(path).read_text())
    print(f"{data['date']}  {data['device']}  torch {data['torch']}  hidden {data['shape']['hidden_size']} "
          f"layers {data['shape']['num_layers']} vocab {data['shape']['vocab_size']}  prompt {data['prompt_len']} "
          f"out {data['max_tokens']}")
    print(f"{'setting':8} {'batch':>5} {'tok/s':>9} {'tok/step':>9} {'ms/step':>9} {'prefill s':>10}")
    for r in data["runs"]:
        print(f"{r['setting']:8} {r['batch']:>5} {r['tokens_per_s']:>9.1f} {r['tokens_per_step']:>9.2f} "
              f"{r['ms_per_step']:>9.2f} {r['prefill_s']:>10.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--summarize", default=None, help="print the table of a results file and exit")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script on a CPU")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.out, SMOKE if args.smoke else SHAPE)
