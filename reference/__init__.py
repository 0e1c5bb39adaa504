"""dflash2.reference: the executable specification.

Contract: clean, minimal, readable fp32 PyTorch. Every equation of the target (Qwen3.5 hybrid:
Gated DeltaNet + gated full attention, dense or MoE, with its MTP head), of the DFlash 2 draft
and of speculative verification is written here once, in the plainest form that runs. The fast
engine (``dflash2.fast``) specializes it and is held to it by ``conformance/``.

Rules: one concept per file, equations in docstrings, shapes at function boundaries
(``# [T, H, D]``), no hidden global state (randomness is an argument), and no import of
``dflash2.fast`` or Triton. This package also owns the formats (config parsing, checkpoint
loading and validation, the tiny checkpoint factory) so both sides load identically.
"""
