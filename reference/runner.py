"""Load a checkpoint folder and decode with the reference: what ``ft generate --engine reference`` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from .formats.checkpoint import load_target
from .formats.config import resolve_mtp_k
from .formats.errors import CheckpointError, ConfigError, expect
from .generate import GenerationResult, generate
from .speculative.proposer import Proposer
from .request.sampling_params import SamplingParams
from .speculative.loop import speculative_generate
from .model.target import ReferenceTarget
from .formats.tokenizer import check_tokenizer_fits, eos_token_ids, has_tokenizer, load_tokenizer

SPECULATIVE_ALGORITHMS = ("none", "mtp", "dflash")


class ReferenceRunner:
    """A target checkpoint (its tokenizer when the folder has one, and an optional proposer) in fp32.

    Every refusal happens here, before any generation: an unknown algorithm, a draft path with
    no dflash, a dflash without a draft, a draft that does not fit the target, a target without
    an MTP head for mtp, or k outside its range.
    """

    def __init__(self, model_path: str | Path, speculative_algorithm: str = "none",
                 draft_model_path: str | Path | None = None, k: int | None = None):
        self.model_path = Path(model_path)
        expect(speculative_algorithm in SPECULATIVE_ALGORITHMS, ConfigError, "speculative_algorithm",
               speculative_algorithm, f"one of {SPECULATIVE_ALGORITHMS}")
        if speculative_algorithm != "dflash" and draft_model_path:
            raise ConfigError(f"speculative_draft_model_path={str(draft_model_path)!r}: only used with "
                              f"speculative_algorithm 'dflash', got {speculative_algorithm!r}")
        if speculative_algorithm == "none" and k is not None:
            raise ConfigError(f"speculative_num_steps={k!r}: only used with speculative_algorithm "
                              "'mtp' or 'dflash'")
        cfg, weights = load_target(self.model_path)
        self.algorithm = speculative_algorithm
        self.target = ReferenceTarget(cfg, weights)
        self.k: int | None = None
        self._new_proposer: Callable[[], Proposer] | None = None
        if speculative_algorithm == "mtp":
            self._setup_mtp(cfg, weights, k)
        elif speculative_algorithm == "dflash":
            self._setup_dflash(cfg, weights, draft_model_path, k)
        self.tokenizer = None
        if has_tokenizer(self.model_path):
            self.tokenizer = load_tokenizer(self.model_path)
            check_tokenizer_fits(self.tokenizer, cfg.vocab_size)
        self.stop_token_ids = eos_token_ids(self.model_path, self.tokenizer)

    def _setup_mtp(self, cfg, weights, k: int | None) -> None:
        from .model.mtp import ReferenceMTP
        from .speculative.mtp import MTPProposer

        k = resolve_mtp_k(cfg, k)
        mtp = ReferenceMTP(cfg, weights)
        self.k = k
        self._new_proposer = lambda: MTPProposer(mtp)

    def _setup_dflash(self, cfg, weights, draft_model_path, k: int | None) -> None:
        from .speculative.dflash import DFlashProposer
        from .model.draft import ReferenceDraft
        from .formats.draft_checkpoint import load_draft

        draft_cfg, draft_weights = load_draft(draft_model_path, cfg, k)
        draft = ReferenceDraft(draft_cfg, draft_weights, weights)
        self.k = draft_cfg.k
        self._new_proposer = lambda: DFlashProposer(draft)

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
        if self._new_proposer is None:
            return generate(self.target, prompt_ids, params, self.stop_token_ids, decode)
        return speculative_generate(self.target, self._new_proposer(), prompt_ids, params, self.k,
                                    self.stop_token_ids, decode)
