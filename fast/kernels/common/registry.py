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
               ("dflash2.fast.kernels.sampling.philox:keyed_uniform_torch", "dflash2.fast.kernels.sampling.philox:keyed_uniform_triton"),
               "dflash2.reference.request.rng:uniform", "conformance/ops/test_philox.py"),
    KernelTwin("target_probs",
               ("dflash2.fast.kernels.sampling.sampler:target_probs_torch", "dflash2.fast.kernels.sampling.sampler:target_probs_triton"),
               "dflash2.reference.speculative.sampling:target_probs", "conformance/ops/test_sampler.py"),
    KernelTwin("sample",
               ("dflash2.fast.kernels.sampling.sampler:sample_torch", "dflash2.fast.kernels.sampling.sampler:sample_triton"),
               "dflash2.reference.speculative.sampling:sample_from_probs", "conformance/ops/test_sampler.py"),
    KernelTwin("row_filter",  # the sort-free top-k/top-p cut; its twin sorts every row
               ("dflash2.fast.kernels.sampling.row_filter:filter_torch", "dflash2.fast.kernels.sampling.row_filter:filter_triton"),
               "dflash2.reference.speculative.sampling:target_probs", "conformance/ops/test_sampler.py"),
    KernelTwin("rejection",
               ("dflash2.fast.kernels.sampling.rejection:verify_torch", "dflash2.fast.kernels.sampling.rejection:verify_triton"),
               "dflash2.reference.speculative.verify:verify_sampled_keyed", "conformance/ops/test_rejection.py"),
    KernelTwin("selector",
               ("dflash2.fast.kernels.draft.selector:select_torch", "dflash2.fast.kernels.draft.selector:select_triton"),
               "dflash2.reference.speculative.selector:select", "conformance/ops/test_selector.py"),
    KernelTwin("ring_attention",
               ("dflash2.fast.kernels.draft.ring_attention:ring_attention_torch",
                "dflash2.fast.kernels.draft.ring_attention:ring_attention_triton"),
               "dflash2.reference.model.draft:window_attention", "conformance/ops/test_ring_attention.py"),
    KernelTwin("dynamic_conv",  # one side of the draft's grouped dynamic conv, the residual add fused in
               ("dflash2.fast.kernels.draft.dynamic_conv:grouped_dynamic_conv_torch",
                "dflash2.fast.kernels.draft.dynamic_conv:grouped_dynamic_conv_triton"),
               "dflash2.reference.model.conv:grouped_dynamic_conv", "conformance/ops/test_dynamic_conv.py"),
    KernelTwin("conv_finish_norm",  # the conv finish + residual add + the next Qwen3 norm; the test composes both
               ("dflash2.fast.kernels.draft.conv_finish_norm:conv_finish_norm_torch",
                "dflash2.fast.kernels.draft.conv_finish_norm:conv_finish_norm_triton"),
               "dflash2.reference.model.conv:grouped_dynamic_conv", "conformance/ops/test_conv_finish_norm.py"),
    KernelTwin("draft_qk_norm_rope",  # the draft's per-head Qwen3 norms + full RoPE; the test composes the reference's
               ("dflash2.fast.kernels.attention.attention_prologue:draft_qk_norm_rope_torch",
                "dflash2.fast.kernels.attention.attention_prologue:draft_qk_norm_rope_triton"),
               "dflash2.reference.model.draft:qwen3_rms_norm", "conformance/ops/test_attention_prologue.py"),
    KernelTwin("gdn_recurrent",
               ("dflash2.fast.kernels.gdn.gdn_recurrent:gated_delta_rule_verify_torch",
                "dflash2.fast.kernels.gdn.gdn_recurrent:gated_delta_rule_verify_triton"),
               "dflash2.reference.model.delta_rule:gated_delta_rule_recurrent", "conformance/ops/test_gdn_recurrent.py"),
    KernelTwin("gdn_commit",  # replays the kept verify rows on the slot's state, the reference's rollback
               ("dflash2.fast.kernels.gdn.gdn_commit:commit_verify_torch",
                "dflash2.fast.kernels.gdn.gdn_commit:commit_verify_triton"),
               "dflash2.reference.speculative.loop:verify_step", "conformance/ops/test_gdn_commit.py"),
    KernelTwin("paged_attention",  # torch twin: a gather of the whole context
               ("dflash2.fast.kernels.attention.paged_attention:paged_attention_torch",
                "dflash2.fast.kernels.attention.paged_attention:paged_attention_triton"),
               "dflash2.reference.model.attention:causal_attention", "conformance/ops/test_paged_attention.py"),
    KernelTwin("gdn_prefill",  # flash-linear-attention's chunked Triton kernels, CUDA only; no torch twin of its own
               ("dflash2.fast.kernels.gdn.gdn_prefill:gated_delta_rule_prefill_fla",),
               "dflash2.reference.model.delta_rule:gated_delta_rule_recurrent", "conformance/ops/test_gdn_prefill.py"),
    KernelTwin("moe",  # torch twin: one matmul pair per active expert, a host sync
               ("dflash2.fast.kernels.moe.moe:moe_experts_torch", "dflash2.fast.kernels.moe.moe:moe_experts_triton"),
               "dflash2.reference.model.moe:routed_experts", "conformance/ops/test_moe.py"),
    KernelTwin("moe_grouped",  # prefill's routed experts; twins: moe.py's torch form and the alignment written out
               ("dflash2.fast.kernels.moe.moe_grouped:align_by_expert_torch",
                "dflash2.fast.kernels.moe.moe_grouped:moe_experts_grouped"),
               "dflash2.reference.model.moe:routed_experts", "conformance/ops/test_moe_grouped.py"),
    KernelTwin("moe_router",  # softmax + top-k + renormalise; the torch twin breaks ties by the lowest id
               ("dflash2.fast.kernels.moe.moe_router:route_torch", "dflash2.fast.kernels.moe.moe_router:route_triton"),
               "dflash2.reference.model.moe:route", "conformance/ops/test_moe_router.py"),
    KernelTwin("add_rms_norm",  # torch twin: the residual add then the zero-centred norm
               ("dflash2.fast.kernels.dense.rms_norm:add_rms_norm_torch", "dflash2.fast.kernels.dense.rms_norm:add_rms_norm_triton"),
               "dflash2.reference.model.norm:rms_norm", "conformance/ops/test_rms_norm.py"),
    KernelTwin("gated_rms_norm",
               ("dflash2.fast.kernels.dense.rms_norm:gated_rms_norm_torch", "dflash2.fast.kernels.dense.rms_norm:gated_rms_norm_triton"),
               "dflash2.reference.model.norm:gated_rms_norm", "conformance/ops/test_rms_norm.py"),
    KernelTwin("gdn_prologue",  # conv + silu + l2norms + g/beta; the test composes the reference's pieces
               ("dflash2.fast.kernels.gdn.gdn_prologue:gdn_prologue_torch", "dflash2.fast.kernels.gdn.gdn_prologue:gdn_prologue_triton"),
               "dflash2.reference.model.gdn:causal_conv1d", "conformance/ops/test_gdn_prologue.py"),
    KernelTwin("qk_norm_rope",  # per-head norms + RoPE + the K/V write; the test composes rms_norm and apply_rope
               ("dflash2.fast.kernels.attention.attention_prologue:qk_norm_rope_torch",
                "dflash2.fast.kernels.attention.attention_prologue:qk_norm_rope_triton"),
               "dflash2.reference.model.rope:apply_rope", "conformance/ops/test_attention_prologue.py"),
    KernelTwin("skinny_linear",  # x @ W.T at a few rows, optionally SwiGLU'd; the test holds it to the exact product
               ("dflash2.fast.kernels.dense.skinny_linear:skinny_linear_torch",
                "dflash2.fast.kernels.dense.skinny_linear:skinny_linear_triton"),
               "dflash2.reference.model.mlp:swiglu", "conformance/ops/test_skinny_linear.py"),
    KernelTwin("swiglu",  # silu(gate) * up of the fused gate|up GEMM output; the reference's is inside its swiglu
               ("dflash2.fast.kernels.dense.swiglu:swiglu_act_torch", "dflash2.fast.kernels.dense.swiglu:swiglu_act_triton"),
               "dflash2.reference.model.mlp:swiglu", "conformance/ops/test_swiglu.py"),
    KernelTwin("output_gate",  # the reference's gate is the line attn * sigmoid(gate) of GatedAttention.forward
               ("dflash2.fast.kernels.attention.attention_prologue:output_gate_torch",
                "dflash2.fast.kernels.attention.attention_prologue:output_gate_triton"),
               "dflash2.reference.model.attention:GatedAttention", "conformance/ops/test_attention_prologue.py"),
    KernelTwin("context_k_norm_rope",  # the draft's context k_norm + RoPE + [L, N] layout; the test runs the reference
               ("dflash2.fast.kernels.draft.context_kv:context_k_norm_rope_torch",  # ReferenceDraft.context_kv
                "dflash2.fast.kernels.draft.context_kv:context_k_norm_rope_triton"),
               "dflash2.reference.model.draft:ReferenceDraft", "conformance/ops/test_context_kv.py"),
    KernelTwin("quant_dequant",  # a GGUF weight's blocks to values; the reference reads them through gguf-py's numpy code
               ("dflash2.fast.kernels.quant.dequant_torch:dequantize_torch",
                "dflash2.fast.kernels.quant.dequant_triton:dequantize_triton"),
               "dflash2.reference.formats.gguf_file:dequantize", "conformance/ops/test_quant_dequant.py"),
    KernelTwin("quant_matmul",  # x @ W^T straight from the blocks; the reference multiplies the dequantized matrix
               ("dflash2.fast.kernels.quant.quant_matmul:quant_matmul_torch",
                "dflash2.fast.kernels.quant.quant_matmul:quant_matmul_triton"),
               "dflash2.reference.formats.gguf_file:dequantize", "conformance/ops/test_quant_linear.py"),
)
