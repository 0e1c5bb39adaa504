"""``ft generate --compare-plain``: the speculative run beside plain decoding, on one machine, in one run.

The speculative request runs first (after a 4-token warm-up of its engine), then a second engine
with no speculation decodes the same prompt with the same sampling parameters (after its own
warm-up). Each side's decode speed is output tokens / decode seconds (prefill excluded, as the
engine's timing reports it), so the speedup is the ratio a user of either setting would see. With
greedy sampling the two outputs must be equal (speculative decoding is exact); the report says
whether they are.
"""

from __future__ import annotations

from dataclasses import replace

WARMUP_TOKENS = 4


def decode_tokens_per_s(result) -> float | None:
    seconds = result.timing.get("decode_s") or 0.0
    return len(result.token_ids) / seconds if seconds > 0 else None


def compare_with_plain(llm, prompt_ids: list[int], params, speculative_result) -> dict:
    """Run plain decoding of the same request; return both sides' figures."""
    from .llm import LLM

    plain = LLM.from_config(replace(llm.config, speculative_algorithm="none", speculative_draft_model_path=None,
                                    speculative_num_steps=None))
    plain.generate([prompt_ids], replace(params, max_tokens=WARMUP_TOKENS))
    plain_result = plain.generate([prompt_ids], params)[0]
    spec_speed, plain_speed = decode_tokens_per_s(speculative_result), decode_tokens_per_s(plain_result)
    return {
        "speculative_algorithm": llm.config.speculative_algorithm,
        "num_steps": llm.k,
        "tokens_per_step": round(speculative_result.tokens_per_step, 3),
        "speculative_tokens_per_s": round(spec_speed, 1) if spec_speed else None,
        "plain_tokens_per_s": round(plain_speed, 1) if plain_speed else None,
        "speedup": round(spec_speed / plain_speed, 3) if spec_speed and plain_speed else None,
        "greedy": params.temperature == 0 or params.top_k == 1,
        "outputs_equal": speculative_result.token_ids == plain_result.token_ids,
        "device": str(llm.engine.model.pools.device),
    }


def format_comparison(c: dict) -> str:
    name = {"dflash": "DFlash", "mtp": "MTP"}.get(c["speculative_algorithm"], c["speculative_algorithm"])
    lines = [f"{name} k={c['num_steps']}: {c['tokens_per_step']:.2f} tokens per verify step, "
             f"{c['speculative_tokens_per_s']} tokens/s",
             f"plain decoding: {c['plain_tokens_per_s']} tokens/s",
             f"speedup: {c['speedup']}x over plain decoding (same prompt, same {c['device']} machine, this run)"]
    if c["greedy"]:
        lines.append("outputs identical to plain greedy decoding: " + ("yes" if c["outputs_equal"] else "NO"))
    return "\n".join(lines)
