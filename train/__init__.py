"""The training recipe: a small Qwen3.5 target, its MTP head and a DFlash 2 draft, from offline text.

Stages (``ft train <stage>``), each resumable and at most about 10 minutes on one H200:
corpus (CPU) -> tokenizer (CPU) -> target -> draft and MTP against the frozen target -> export
(bf16 safetensors in real HF layouts, files of at most 16 MB) -> evaluate. ``train/model/`` holds
differentiable, batched twins of the reference forwards (tests hold them to the reference).
"""
