"""Greedy ``ft generate --engine reference`` equals transformers' greedy generation token for token,
on the folder ``ft make-tiny`` wrote; ``--chat --prompt`` encodes exactly what the chat template gives."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import PreTrainedTokenizerFast

PROMPTS = ["5,17,42,99,3", "300,1,1,1,250,7,480,64"]


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    inputs = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_greedy_cli_equals_transformers_generate(made, ft, greedy_args, preset):
    path = made(preset).target
    for prompt in PROMPTS:
        out = ft(*greedy_args(path, prompt_ids=prompt, max_tokens=12)).json()
        prompt_ids = [int(t) for t in prompt.split(",")]
        assert out["prompt_token_ids"] == prompt_ids
        assert out["finish_reason"] == "length"
        assert len(out["token_ids"]) == 12
        assert out["token_ids"] == hf_greedy(path, prompt_ids, 12), (preset, prompt)
        assert out["samples"][0]["token_ids"] == out["token_ids"]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_chat_prompt_ids_are_the_chat_template_encoding(made, ft, preset):
    path = made(preset).target
    text = "Hello, how are you? Ünïcödé too."
    out = ft("generate", "--model", path, "--chat", "--prompt", text, "--temperature", "0", "--json",
             "--max-tokens", "4", "--ignore-eos").json()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert out["prompt_token_ids"] == list(expected)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.startswith("<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(out["prompt_token_ids"]) == rendered
    # without --chat the same text is encoded bare, with no template around it
    bare = ft("generate", "--model", path, "--prompt", text, "--temperature", "0", "--json", "--max-tokens", "1")
    assert bare.json()["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)

