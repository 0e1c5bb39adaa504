"""``ft generate``: decode one prompt on the fast engine, or with ``--engine reference`` on the fp32 executable
spec (the flags, ``--json`` and ``--trace`` are the same). Flag defaults are read from the dataclasses they
fill (``SamplingParams``, ``EngineConfig``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from dflash2.reference.formats.errors import UserInputError
from dflash2.reference.request.sampling_params import SamplingParams

from dflash2.fast.engine.config import add_engine_args

ENGINES = ("fast", "reference")
ALGORITHMS = ("none", "mtp", "dflash")
K_HELP = "drafts per verify step k (default: block_size - 1 for dflash, 3 for mtp)"


def _default(field_name: str):
    return {f.name: f for f in fields(SamplingParams)}[field_name].default


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``--speculative-algorithm``, ``--speculative-draft-model-path``, ``--speculative-num-steps`` (k)."""
    p.add_argument("--speculative-algorithm", choices=ALGORITHMS, default="none")
    p.add_argument("--speculative-draft-model-path", default=None, help="DFlash 2 draft checkpoint folder")
    p.add_argument("--speculative-num-steps", type=int, default=None, help=K_HELP)


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt")
    p.add_argument("--model", default=None,
                   help="target checkpoint folder (HF format) or .gguf file (dequantized on load; default: the "
                        "bundled trained pair, models/)")
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="which implementation runs the model (default: %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_prompt_ids, help="prompt token ids, comma separated")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=_default("max_tokens"))
    p.add_argument("--temperature", type=float, default=_default("temperature"), help="0 is greedy")
    p.add_argument("--top-p", type=float, default=_default("top_p"))
    p.add_argument("--top-k", type=int, default=_default("top_k"), help="-1 is off")
    p.add_argument("--seed", type=int, default=_default("seed"))
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--n", type=int, default=1, help="independent samples of the prompt (seeds derived from --seed)")
    add_speculative_args(p)
    p.add_argument("--trace", default=None, help="write one JSON line per verify step to this file")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode the prompt without speculation and print the speedup (fast engine)")
    add_engine_args(p.add_argument_group("fast engine (EngineConfig)"))
    p.set_defaults(func=run_generate)


def _verify_steps(result) -> int:
    """Verify steps of a result: the fast engine counts them (it keeps their records only with --trace)."""
    return getattr(result, "verify_steps", None) or len(result.steps)


def _sample_json(index: int, seed: int, result, speculative: bool) -> dict:
    sample = {"index": index, "seed": seed, "token_ids": result.token_ids, "text": result.text,
              "finish_reason": result.finish_reason, "timing": result.timing}
    if speculative:
        sample["verify_steps"] = _verify_steps(result)
        sample["tokens_per_step"] = result.tokens_per_step
    return sample


def _open_trace(path: str):
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise UserInputError(f"trace={path!r}: expected a writable file path ({exc.strerror})") from None


def run_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dflash2.reference.request.rng import derive_seed
    from dflash2.reference.runner import ReferenceRunner

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    if args.n < 1:
        raise UserInputError(f"n={args.n}: expected an integer >= 1")
    if args.chat and args.prompt is None:
        raise UserInputError("--chat: expected --prompt text (it cannot wrap --prompt-ids)")
    if args.compare_plain and (args.engine != "fast" or args.speculative_algorithm == "none" or args.n != 1):
        raise UserInputError(f"compare_plain: expected --engine fast, a --speculative-algorithm other than none and "
                             f"--n 1 (got engine {args.engine!r}, algorithm {args.speculative_algorithm!r}, n {args.n})")
    if args.engine == "fast":
        runner = _FastRunner(args)
        args.model = runner.model_path
    else:
        if args.load_format != "auto":
            raise UserInputError(f"load_format={args.load_format!r}: the reference engine reads the checkpoint's "
                                 "tensors; expected 'auto' (dummy weights are for --engine fast)")
        from dflash2.models import resolve_model_paths

        args.model, draft = resolve_model_paths(args.model, args.speculative_algorithm,
                                                args.speculative_draft_model_path)
        runner = ReferenceRunner(args.model, speculative_algorithm=args.speculative_algorithm,
                                 draft_model_path=draft,
                                 k=args.speculative_num_steps)
    if args.prompt is not None:
        prompt_ids = runner.encode(args.prompt, chat=args.chat)
    else:
        prompt_ids = args.prompt_ids
    seeds = [params.seed] if args.n == 1 else [derive_seed(params.seed, i) for i in range(args.n)]
    trace = _open_trace(args.trace) if args.trace else None  # a bad path fails before, not after, generating
    try:
        if args.engine == "fast":  # the --n samples run as one continuous batch
            if args.compare_plain:  # first-call costs stay out of the timed run, as on the plain side
                from dflash2.fast.compare import WARMUP_TOKENS

                runner.generate_all(prompt_ids, [replace(params, max_tokens=WARMUP_TOKENS)])
            results = runner.generate_all(prompt_ids, [replace(params, seed=seed) for seed in seeds])
        else:
            results = [runner.generate(prompt_ids, replace(params, seed=seed)) for seed in seeds]
        if trace is not None:
            for index, result in enumerate(results):
                for step_index, step in enumerate(getattr(result, "steps", [])):
                    trace.write(json.dumps({"sample": index, "step": step_index, **step.to_json()}) + "\n")
    finally:
        if trace is not None:
            trace.close()
    comparison = None
    if args.compare_plain:
        from dflash2.fast.compare import compare_with_plain

        comparison = compare_with_plain(runner.llm, prompt_ids, params, results[0])
    if args.json:
        speculative = args.speculative_algorithm != "none"
        samples = [_sample_json(i, seed, r, speculative) for i, (seed, r) in enumerate(zip(seeds, results))]
        print(json.dumps({"engine": args.engine, "speculative_algorithm": args.speculative_algorithm,
                          "num_steps": runner.k, "prompt_token_ids": list(prompt_ids),
                          "token_ids": results[0].token_ids, "text": results[0].text,
                          "finish_reason": results[0].finish_reason, "timing": results[0].timing,
                          "samples": samples, **({"comparison": comparison} if comparison else {})}))
    else:
        for result in results:
            print(result.text)
        if args.speculative_algorithm != "none":  # the text alone would not show that speculation ran
            steps = [_verify_steps(r) for r in results]
            per_step = sum(r.tokens_per_step * n for r, n in zip(results, steps)) / max(sum(steps), 1)
            print(f"{args.speculative_algorithm} k={runner.k}: {per_step:.2f} tokens per verify step "
                  f"({sum(steps)} steps, {args.engine} engine)", file=sys.stderr)
        if comparison:
            from dflash2.fast.compare import format_comparison

            print("\n" + format_comparison(comparison))
    return 0


class _FastRunner:
    """``ft generate --engine fast``: the fast engine behind the reference runner's three calls."""

    def __init__(self, args: argparse.Namespace):
        from dflash2.fast.engine.config import engine_config_from_args
        from dflash2.fast.llm import LLM

        config = engine_config_from_args(args)
        self.model_path = config.model_path
        self.llm = LLM.from_config(config, trace=bool(args.trace))
        self.k = self.llm.k

    def encode(self, text: str, chat: bool = False) -> list[int]:
        from pathlib import Path

        from dflash2.reference.formats.errors import CheckpointError

        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise CheckpointError(f"{Path(self.model_path)}: no tokenizer files, so --prompt text cannot be encoded "
                                  "(give --prompt-ids instead)")
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def generate_all(self, prompt_ids: list[int], params: list[SamplingParams]) -> list:
        outputs = self.llm.generate([prompt_ids] * len(params), params)
        for out in outputs:
            if out.error is not None:
                raise UserInputError(out.error)
        return outputs
