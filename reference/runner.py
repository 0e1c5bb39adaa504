"""Load a checkpoint folder and decode with the reference: what ``ft generate --engine reference`` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .checkpoint import load_target
from .errors import CheckpointError
from .generate import GenerationResult, generate
from .sampling_params import SamplingParams
from .target import ReferenceTarget
from .tokenizer import check_tokenizer_fits, eos_token_ids, has_tokenizer, load_tokenizer


class ReferenceRunner:
    """A target checkpoint (and its tokenizer, when the folder has one) ready to decode in fp32."""

    def __init__(self, model_path: str | Path):
        self.model_path = Path(model_path)
        cfg, weights = load_target(self.model_path)
        self.target = ReferenceTarget(cfg, weights)
        self.tokenizer = None
        if has_tokenizer(self.model_path):
            self.tokenizer = load_tokenizer(self.model_path)
            check_tokenizer_fits(self.tokenizer, cfg.vocab_size)
        self.stop_token_ids = eos_token_ids(self.model_path, self.tokenizer)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise CheckpointError(f"{self.model_path}: no tokenizer files, so --prompt text cannot be encoded "
                                  "(give --prompt-ids instead)")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        decode = self.decode if self.tokenizer is not None else None
        return generate(self.target, prompt_ids, params, self.stop_token_ids, decode)
