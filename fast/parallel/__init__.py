"""Tensor parallelism of the fast target, as vLLM and SGLang shard a decoder (Megatron-style).

``group`` the rank's :class:`TPGroup` (rank, size, process group; collectives that are the identity at
size 1); ``plan`` how each canonical tensor splits across ranks and the per-rank config view;
``vocab`` the vocabulary-parallel embedding and LM head. ``fast/model/`` builds on it (it sits between
``kernels`` and ``model`` and imports neither): :class:`~dflash2.fast.model.params.Params` given a ``tp``
serves each tensor already cut for its rank, the modules and cache pools take the rank's config view
(local head counts, local intermediate sizes), and the decoder layer all-reduces after every row-parallel
projection (fast/model/layer.py).
"""

from .group import TPGroup
from .plan import ShardSpec, rank_config, shard_spec, shard_tensor

__all__ = ["ShardSpec", "TPGroup", "rank_config", "shard_spec", "shard_tensor"]
