"""The offline API: ``LLM(model_path, ...).generate(prompts, sampling_params)``.

    llm = LLM("runs/tiny-dense", speculative_algorithm="dflash", speculative_draft_model_path="runs/tiny-draft")
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9))[0]
    out.token_ids, out.text, out.finish_reason, out.stats

``model_path`` None loads the bundled trained pair (``models/``; its draft too when ``dflash`` is
asked for with no draft path). ``dtype`` None picks bfloat16 on CUDA and float32 on CPU (CPU bf16 is slow, and the CPU lane is
where the engine is held token for token to the fp32 reference); a torch dtype or its name
overrides. ``device`` None picks CUDA when a GPU is visible. Any other ``EngineConfig`` field can be
passed by name. An unfit checkpoint or draft is refused here, with the reference's errors; a bad
request (sampling value, prompt ids, length) fails alone, in its ``RequestOutput.error``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dflash2.reference.request.sampling_params import SamplingParams

from .engine.config import AUTO, EngineConfig
from .engine.engine import Engine, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


class LLM:
    def __init__(self, model_path: str | Path | None = None, dtype: torch.dtype | str | None = None, max_running_req: int = 4,
                 speculative_algorithm: str | None = None, speculative_draft_model_path: str | Path | None = None,
                 speculative_num_steps: int | None = None, device: str | torch.device | None = None,
                 trace: bool = False, **engine_args):
        from dflash2.models import resolve_model_paths

        model_path, speculative_draft_model_path = resolve_model_paths(model_path, speculative_algorithm,
                                                                       speculative_draft_model_path)
        config = EngineConfig(
            model_path=model_path, dtype=AUTO if dtype is None else dtype,
            device=AUTO if device is None else str(device), max_running_req=max_running_req,
            speculative_algorithm=speculative_algorithm or "none",
            speculative_draft_model_path=speculative_draft_model_path,
            speculative_num_steps=speculative_num_steps, **engine_args)
        self._start(config, trace)

    @classmethod
    def from_config(cls, config: EngineConfig, trace: bool = False) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, trace)
        return llm

    def _start(self, config: EngineConfig, trace: bool) -> None:
        self.engine = Engine(config, trace=trace)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (tensor_parallel_size > 1; nothing at 1). Idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def k(self) -> int | None:
        return self.engine.k

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. ``prompts``: texts or token id lists (one of either alone is
        taken as a batch of one); one SamplingParams for all, or one per prompt."""
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * len(prompts)
        return self.engine.generate(list(prompts), list(sampling_params))
