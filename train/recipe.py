"""What the recipe trains: model shapes and per-stage budgets, in one dataclass saved with the run.

The default pair fits the bundled-model budget (about 32 MB of bf16 safetensors in all):

- target: Qwen3.5 dense hybrid, hidden 256, 8 layers (GDN, GDN, GDN, gated full attention) x 2,
  4 query / 2 KV heads of 64, GDN 2 key / 4 value heads of 64, MLP 768, tied embeddings, one MTP
  layer; vocabulary = the 8192-id tokenizer plus 64 unused ids (the last is the draft's mask
  token, which the tokenizer never emits). About 9.9M parameters, 19.8 MB in bf16.
- draft: DFlash 2, 3 layers at the target's hidden size, block 8, taps of target layers 1, 4, 7
  (early, middle, last: the released drafts also tap spread layers ending near the top), selector
  rank 64 over the top-16. About 3.7M parameters, 7.4 MB in bf16.

Budgets are wall-clock seconds per stage (each stage fits one 10-minute device call with room for
start-up and export); the learning rate follows the elapsed fraction of that budget, so a stage
that runs slower than planned still finishes its schedule instead of stopping mid-warm-up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from dflash2.reference.formats.errors import UserInputError


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int = 256
    num_layers: int = 8
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    intermediate_size: int = 768
    vocab_padding: int = 64  # ids past the tokenizer's; the last one is the draft's mask token
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class DraftShape:
    num_layers: int = 3
    target_layer_ids: tuple[int, ...] = (1, 4, 7)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 8
    sliding_window: int = 2048
    selector_rank: int = 64
    selector_top_k: int = 16


@dataclass(frozen=True)
class StageBudget:
    seconds: float  # wall-clock training time (excluding start-up and export)
    seq_len: int
    batch_size: int  # sequences per step
    lr: float
    warmup_steps: int = 100
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vocab_size: int = 8192  # tokenizer ids, special tokens included
    heldout_percent: int = 2
    target: TargetShape = TargetShape()
    draft: DraftShape = DraftShape()
    target_stage: StageBudget = StageBudget(seconds=330, seq_len=1024, batch_size=64, lr=3e-3)
    # The MTP head trains with the target (detached hidden, so the target's loss is its own), then
    # is fine-tuned beside the draft against the frozen target.
    mtp_loss_weight: float = 0.3
    draft_stage: StageBudget = StageBudget(seconds=330, seq_len=1024, batch_size=32, lr=2e-3)
    anchors_per_seq: int = 64
    # Slot i of a block is weighted exp(-(i-1)/gamma) (the DFlash paper's decay; 4 for block 8).
    loss_decay_gamma: float = 4.0
    selector_loss_weight: float = 0.5
    mtp_chain_steps: int = 3  # unrolled MTP steps in its fine-tune, weighted with the same decay
    # refine: the draft (and MTP head) continue on text the target generated (generate_data.py).
    # Generation gets the larger share: 45 s at 64 requests (0.49M tokens, each seen 63 times in
    # 150 s of training) was memorised; 512 requests in flight keep the step full.
    generate_seconds: float = 170
    generate_prompt_len: int = 128
    generate_new_tokens: int = 385
    generate_concurrency: int = 512
    refine_stage: StageBudget = StageBudget(seconds=240, seq_len=512, batch_size=64, lr=1e-3, warmup_steps=20)
    compile: bool = False  # torch.compile the training step's model forwards

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Recipe:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise UserInputError(f"recipe fields {unknown}: unknown; expected some of {sorted(known)}")
        nested = {"target": TargetShape, "draft": DraftShape, "target_stage": StageBudget, "draft_stage": StageBudget,
                  "refine_stage": StageBudget}
        kwargs = {}
        for name, value in obj.items():
            if name in nested:
                value = dict(value)
                if name == "draft" and "target_layer_ids" in value:
                    value["target_layer_ids"] = tuple(value["target_layer_ids"])
                value = nested[name](**value)
            kwargs[name] = value
        return cls(**kwargs)

    def model_vocab_size(self) -> int:
        return self.vocab_size + self.target.vocab_padding


def load_recipe(run_dir: Path) -> Recipe:
    path = Path(run_dir) / "recipe.json"
    if not path.exists():
        return Recipe()
    return Recipe.from_json(json.loads(path.read_text()))


def save_recipe(run_dir: Path, recipe: Recipe) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "recipe.json").write_text(json.dumps(recipe.to_json(), indent=2, sort_keys=True) + "\n")


def smoke_recipe() -> Recipe:
    """A recipe of seconds on a CPU: the test suite's smoke run of every stage."""
    return Recipe(
        vocab_size=320,
        target=TargetShape(hidden_size=32, num_layers=4, full_attention_interval=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                           linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=64),
        draft=DraftShape(num_layers=1, target_layer_ids=(1, 3), num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, selector_rank=8),
        target_stage=StageBudget(seconds=4, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2),
        draft_stage=StageBudget(seconds=4, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2),
        anchors_per_seq=4,
        generate_seconds=2, generate_prompt_len=16, generate_new_tokens=49, generate_concurrency=4,
        refine_stage=StageBudget(seconds=3, seq_len=64, batch_size=4, lr=1e-3, warmup_steps=2),
    )

