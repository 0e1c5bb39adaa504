"""Stage ``evaluate``: what the trained pair does on held-out prompts, through the serving engine.

Prompts are the openings of held-out corpus files (never trained on: the split is by file), cut
at a line end after about ``prompt_tokens`` tokens: Python source and documentation text, a few
each. Every setting runs the same prompts, one request at a time (``max_running_req`` 1: the
latency a single user sees), on the fast engine with CUDA graphs where the machine has a GPU,
after an untimed pass of the same requests (graph capture and kernel compilation stay out):

- ``off``: plain decoding; ``mtp`` k = 3, 7: the target's MTP head; ``dflash`` k = 3, 7: the draft;
- greedy, and temperature 1 with top-p 0.95 (the seed's sampled setting, minus its top-k).

Reported per setting: tokens per verify step (committed tokens / verify steps, over all prompts),
output tokens per second (output tokens / decode seconds, summed over prompts, prefill excluded),
and the speedup over ``off`` measured in the same run. Greedy outputs of every speculative
setting are compared token for token with plain greedy decoding (they must be equal up to
numerical near-ties of the bf16 forwards, which the report counts).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SETTINGS = (("off", "none", None), ("mtp3", "mtp", 3), ("mtp7", "mtp", 7), ("dflash3", "dflash", 3),
            ("dflash7", "dflash", 7))
SAMPLING = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0, "top_p": 0.95}}


@dataclass(frozen=True)
class Prompt:
    source: str  # 'code' | 'docs'
    path: str
    token_ids: list[int]


def iter_heldout_files(corpus_dir: Path):
    """(source, path, text) of every held-out file, in build order (the manifest lists them so)."""
    from .corpus import iter_documents, read_manifest

    keys = read_manifest(corpus_dir).heldout_files  # "source/relative/path", in the shards' order
    for key, text in zip(keys, iter_documents(corpus_dir, "heldout"), strict=True):
        source, _, path = key.partition("/")
        yield source, path, text


def heldout_prompts(corpus_dir: Path, tokenizer, per_source: int, prompt_tokens: int) -> list[Prompt]:
    """The first ``per_source`` usable held-out files of each kind, cut at a line end near ``prompt_tokens``."""
    chosen: dict[str, list[Prompt]] = {"code": [], "docs": []}
    for source, path, text in iter_heldout_files(corpus_dir):
        kind = "docs" if source == "docs" else "code"
        if len(chosen[kind]) >= per_source:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < prompt_tokens + 64:  # too short to leave anything to continue
            continue
        cut = tokenizer.decode(ids[:prompt_tokens])
        cut = cut[: cut.rfind("\n") + 1] or cut
        chosen[kind].append(Prompt(kind, path, tokenizer.encode(cut, add_special_tokens=False)))
    return chosen["code"] + chosen["docs"]


def run_setting(target_dir: Path, draft_dir: Path, algorithm: str, k: int | None, prompts: list[Prompt],
                sampling: dict, max_tokens: int, device: str, seed: int) -> dict:
    from dflash2.fast.llm import LLM, SamplingParams

    llm = LLM(target_dir, device=device, max_running_req=1, speculative_algorithm=algorithm,
              speculative_draft_model_path=draft_dir if algorithm == "dflash" else None,
              speculative_num_steps=k)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed + i, **sampling)
              for i in range(len(prompts))]
    # Warm-up: the same requests once, untimed. Each new (batch, rows, context-pages) shape captures a
    # CUDA graph (and compiles kernels) the first time it runs; a one-prompt warm-up left later
    # prompts' longer contexts capturing inside the timed pass (seen on the H200: 2-4x slower figures).
    llm.generate([p.token_ids for p in prompts], params)
    wall = time.perf_counter()
    outputs = llm.generate([p.token_ids for p in prompts], params)
    wall = time.perf_counter() - wall
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"evaluation request failed: {out.error}")
    tokens = sum(len(o.token_ids) for o in outputs)
    decode_s = sum(o.timing.get("decode_s", 0.0) for o in outputs)
    steps = sum(o.verify_steps for o in outputs)
    emitted = sum(o.num_emitted for o in outputs)
    by_source = {}
    for kind in sorted({p.source for p in prompts}):
        picked = [o for o, p in zip(outputs, prompts) if p.source == kind]
        s, e = sum(o.verify_steps for o in picked), sum(o.num_emitted for o in picked)
        by_source[kind] = round(e / s, 3) if s else None
    del llm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"tokens": tokens, "decode_s": round(decode_s, 4), "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / decode_s, 1) if decode_s else None,
            "tokens_per_step": round(emitted / steps, 3) if steps else None,
            "tokens_per_step_by_source": by_source if steps else None,
            "outputs": [o.token_ids for o in outputs]}


def evaluate_pair(target_dir: Path, draft_dir: Path, corpus_dir: Path, *, device: str | None = None,
                  per_source: int = 4, prompt_tokens: int = 128, max_tokens: int = 128, seed: int = 0,
                  settings=SETTINGS, sampling_modes=tuple(SAMPLING), log=print) -> dict:
    from dflash2.reference.formats.tokenizer import load_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(target_dir)
    prompts = heldout_prompts(corpus_dir, tokenizer, per_source, prompt_tokens)
    if not prompts:
        raise RuntimeError(f"{corpus_dir}: no held-out file long enough for a {prompt_tokens}-token prompt")
    report = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
              "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "max_tokens": max_tokens,
              "prompts": [{"source": p.source, "path": p.path, "tokens": len(p.token_ids)} for p in prompts],
              "results": {}}
    for mode in sampling_modes:
        rows = {}
        for name, algorithm, k in settings:
            rows[name] = run_setting(target_dir, draft_dir, algorithm, k, prompts, SAMPLING[mode], max_tokens,
                                     device, seed)
            log(f"evaluate {mode} {name}: " + json.dumps({key: v for key, v in rows[name].items() if key != "outputs"}))
        base = rows.get("off", {}).get("tokens_per_s")
        for name, row in rows.items():
            row["speedup_vs_off"] = round(row["tokens_per_s"] / base, 3) if base and row["tokens_per_s"] else None
            if mode == "greedy" and "off" in rows and name != "off":
                row["greedy_equal_prompts"] = sum(a == b for a, b in zip(row["outputs"], rows["off"]["outputs"]))
        for row in rows.values():
            row.pop("outputs")
        report["results"][mode] = rows
    return report


def markdown_table(report: dict) -> str:
    lines = []
    for mode, rows in report["results"].items():
        lines += [f"### {mode}", "", "| setting | tokens/step | code | docs | tokens/s | speedup vs off | greedy = off |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            src = row.get("tokens_per_step_by_source") or {}
            lines.append(f"| {name} | {row['tokens_per_step'] or '-'} | {src.get('code', '-')} | {src.get('docs', '-')} "
                         f"| {row['tokens_per_s']} | {row['speedup_vs_off']} | "
                         f"{row.get('greedy_equal_prompts', '-')} |")
        lines.append("")
    return "\n".join(lines)
