"""The fp32 forwards: the Qwen3.5 hybrid target (layers, MoE, MTP head) and the DFlash 2 draft.
Twins: ``fast/model/`` (layer by layer, held to these by ``conformance/layers`` and ``conformance/draft``)."""
