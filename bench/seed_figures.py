"""The seed's KV-cache sizes (its "All settings" table, ../shared/seed: ``LLM(model, dtype=bf16, max_running_req=4)``
with default memory settings, on an H100 80 GB), for ft bench to set beside what our memory plan sizes at the same
shape. The real shapes are recognised by their config (bench/shapes/: the 27B dense, the 35B-A3B MoE), so a run at
another shape or card reports no comparison."""

from __future__ import annotations

from dflash2.reference.formats.config import TargetConfig

# (hidden_size, num_hidden_layers, num_experts or 0) -> {ft bench setting: KV tokens the seed's engine sized}
SEED_KV_TOKENS = {
    (5120, 64, 0): {"off": 253435, "mtp3": 225733, "mtp7": 224687, "dflash3": 182950, "dflash7": 181742},  # 27B
    (2048, 40, 256): {"off": 224198, "mtp3": 127668, "mtp7": 126088, "dflash3": 144146, "dflash7": 142110},  # 35B-A3B
}
SEED_CARD_GIB = (79.0, 81.0)  # an 80 GB card's memory as torch reports it (the H100's 79.6 GiB)


def seed_kv_tokens(cfg: TargetConfig, setting: str, device_total_bytes: int | None) -> int | None:
    """The seed's KV tokens for this shape and setting on the seed's card size, or None (another shape or card)."""
    if device_total_bytes is None or not SEED_CARD_GIB[0] <= device_total_bytes / 2**30 <= SEED_CARD_GIB[1]:
        return None
    key = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts if cfg.is_moe else 0)
    return SEED_KV_TOKENS.get(key, {}).get(setting)
