"""The one registry of kernel twins: each fast kernel, its reference twin and its conformance test.

``conformance/ops/test_registry.py`` fails when an entry's callables or test file are missing, or
when a module under ``fast/kernels/`` defines a Triton kernel without an entry here. Paths are
strings (``module:attribute``) so this module imports nothing from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTwin:
    name: str
    fast: tuple[str, ...]  # the torch twin and the Triton launcher, "dflash2.fast.kernels.<module>:<callable>"
    reference: str  # "dflash2.reference.<module>:<callable>"
    test: str  # repository-relative path of the conformance test


KERNELS: tuple[KernelTwin, ...] = (
    KernelTwin("philox",
               ("dflash2.fast.kernels.philox:keyed_uniform_torch", "dflash2.fast.kernels.philox:keyed_uniform_triton"),
               "dflash2.reference.request.rng:uniform", "conformance/ops/test_philox.py"),
    KernelTwin("target_probs",
               ("dflash2.fast.kernels.sampler:target_probs_torch", "dflash2.fast.kernels.sampler:target_probs_triton"),
               "dflash2.reference.speculative.sampling:target_probs", "conformance/ops/test_sampler.py"),
    KernelTwin("sample",
               ("dflash2.fast.kernels.sampler:sample_torch", "dflash2.fast.kernels.sampler:sample_triton"),
               "dflash2.reference.speculative.sampling:sample_from_probs", "conformance/ops/test_sampler.py"),
    KernelTwin("rejection",
               ("dflash2.fast.kernels.rejection:verify_torch", "dflash2.fast.kernels.rejection:verify_triton"),
               "dflash2.reference.speculative.verify:verify_sampled_keyed", "conformance/ops/test_rejection.py"),
    KernelTwin("selector",
               ("dflash2.fast.kernels.selector:select_torch", "dflash2.fast.kernels.selector:select_triton"),
               "dflash2.reference.speculative.selector:select", "conformance/ops/test_selector.py"),
    KernelTwin("ring_attention",
               ("dflash2.fast.kernels.ring_attention:ring_attention_torch",
                "dflash2.fast.kernels.ring_attention:ring_attention_triton"),
               "dflash2.reference.model.draft:window_attention", "conformance/ops/test_ring_attention.py"),
    KernelTwin("gdn_recurrent",
               ("dflash2.fast.kernels.gdn_recurrent:gated_delta_rule_verify_torch",
                "dflash2.fast.kernels.gdn_recurrent:gated_delta_rule_verify_triton"),
               "dflash2.reference.model.delta_rule:gated_delta_rule_recurrent", "conformance/ops/test_gdn_recurrent.py"),
    KernelTwin("gdn_prefill",  # flash-linear-attention's chunked Triton kernels, CUDA only; no torch twin of its own
               ("dflash2.fast.kernels.gdn_prefill:gated_delta_rule_prefill_fla",),
               "dflash2.reference.model.delta_rule:gated_delta_rule_recurrent", "conformance/ops/test_gdn_prefill.py"),
)
