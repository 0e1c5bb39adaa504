"""Stage ``draft``: train the DFlash 2 draft and fine-tune the MTP head against the frozen target.

Per step: the target (frozen, no grad) runs over the windows once and gives the tapped layer
outputs (the draft's context features), its final hidden (the MTP head's input) and its
log-probabilities (the labels of both). Then ``anchors_per_seq`` random anchors per window, one
block per anchor, through the draft; the losses are ``draft_losses.py``'s::

    loss = L_block + selector_loss_weight * L_selector + L_mtp

The draft and the MTP head have disjoint parameters, so one optimizer steps both; the target's
own weights (embedding and LM head included, which the draft borrows) never change. The
``refine`` stage runs the same loop from the draft stage's weights on target-generated rows
(``generate_data.py``), anchors inside the generated part.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash2.reference.formats.checkpoint import load_target

from .draft_losses import (block_positions, draft_losses, expected_tokens_per_step, gather_rows, mtp_chain_loss,
                           sample_anchors, to_python)
from .export import draft_config, write_draft, write_target
from .model.draft import TrainableDraft
from .model.target import TrainableTarget
from .recipe import Recipe, StageBudget
from .state import Progress, StageClock, done_summary, load_state, mark_done
from .target_stage import LOG_EVERY_S, SAVE_EVERY_S, make_optimizer


class DraftAndMTP(torch.nn.Module):
    """What this stage trains, as one module so one state file and one optimizer hold it."""

    def __init__(self, draft: TrainableDraft, target: TrainableTarget):
        super().__init__()
        self.draft = draft
        self.target = target  # frozen except its MTP head

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]


def freeze_all_but_mtp(target: TrainableTarget) -> None:
    for name, p in target.named_parameters():
        p.requires_grad_(name.startswith("mtp."))


def step_losses(both: DraftAndMTP, batch: torch.Tensor, anchors: torch.Tensor, recipe: Recipe, cfg) -> tuple:
    target, draft = both.target, both.draft
    inputs = batch[:, :-1]  # [N, T]
    with torch.no_grad():
        out = target(inputs, tap_layers=cfg.target_layer_ids)
        features = torch.cat([out.taps[layer] for layer in cfg.target_layer_ids], dim=-1)  # [N, T, m*C]
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # [N, T, V]
        rows = block_positions(anchors, cfg.block_size)  # [N, A, B-1]
        slot_logp = gather_rows(logp, rows)  # [N, A, B-1, V]
        prev_ids = gather_rows(inputs, rows)  # [N, A, B-1]: x_{s+i-1}; slot 1's is the anchor token
        block_ids = torch.full((*anchors.shape, cfg.block_size), cfg.mask_token_id, device=inputs.device)
        block_ids[..., 0] = prev_ids[..., 0]
        block_embeds = target.embed_tokens(block_ids)  # [N, A, B, C]
    hidden = draft(features, anchors, block_embeds)  # [N, A, B, C]
    block, selector, figures = draft_losses(draft, hidden, target.lm_head_weight, slot_logp, prev_ids,
                                            recipe.loss_decay_gamma, cfg.selector_top_k)
    loss = block + recipe.selector_loss_weight * selector
    if target.mtp is not None and recipe.mtp_chain_steps > 0:
        mtp, mtp_figures = mtp_chain_loss(target, out.hidden, inputs, logp, recipe.mtp_chain_steps,
                                          recipe.loss_decay_gamma)
        loss = loss + mtp
        figures.update(mtp_figures)
    return loss, figures


def train_draft(run_dir: Path, recipe: Recipe, ids: dict, tokenizer_dir: Path, train,
                device: torch.device, log=print, *, stage: str = "draft", init_from: tuple[Path, Path] | None = None,
                budget: StageBudget | None = None, min_anchor: int = 1) -> dict:
    """Run (or resume, or skip if done) a draft stage; writes ``<run>/<stage>/{model,target}``.

    ``train``: anything with ``train_batch(seed, step, batch_size, seq_len)`` (corpus windows, or
    target-generated rows). ``init_from``: ``(target_dir, draft_dir)`` of a pair whose draft and MTP
    head this one continues from (the refine stage: the draft stage's, or a bundled pair's); else
    the draft starts from its init and the target from ``<run>/target/model``. ``min_anchor``: the first position an anchor may take (the refine
    stage keeps anchors inside the generated part of each row).
    """
    folder = Path(run_dir) / stage
    if (summary := done_summary(folder)) is not None:
        log(f"{stage}: done earlier ({summary['steps']} steps)")
        return summary
    target_dir = Path(init_from[0]) if init_from else Path(run_dir) / "target" / "model"
    target_cfg, weights = load_target(target_dir)
    cfg = draft_config(recipe, target_cfg)
    target = TrainableTarget.from_canonical(target_cfg, weights)
    freeze_all_but_mtp(target)
    if init_from:
        draft = TrainableDraft.from_canonical(cfg, load_file(str(Path(init_from[1]) / "model.safetensors")))
    else:
        draft = TrainableDraft(cfg)
        draft.init_weights(recipe.seed + 1)
    both = DraftAndMTP(draft, target).to(device).train()
    budget = budget or recipe.draft_stage
    optimizer = make_optimizer(both.trainable(), budget.lr, budget.weight_decay, device)
    progress = load_state(folder, both, optimizer) or Progress()
    if progress.step:
        log(f"{stage}: resuming at step {progress.step} ({progress.elapsed_s:.0f} s of {budget.seconds:.0f} s done)")
    step_fn = torch.compile(step_losses) if recipe.compile else step_losses
    clock = StageClock(folder, stage, budget, progress, log, LOG_EVERY_S, SAVE_EVERY_S)
    params = [p for _, p in both.trainable()]
    figures: dict = {}
    while clock.running():
        lr = clock.set_learning_rate(optimizer)
        batch = train.train_batch(recipe.seed + 1, progress.step, budget.batch_size, budget.seq_len).to(device)
        gen = torch.Generator().manual_seed(recipe.seed * 7919 + progress.step)
        anchors = sample_anchors(batch.shape[0], budget.seq_len, recipe.anchors_per_seq, cfg.block_size, gen, device,
                                 low=min_anchor)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, figures = step_fn(both, batch, anchors, recipe, cfg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if clock.step_done(batch[:, :-1].numel()):
            figures = to_python(figures)
            clock.record({"lr": lr, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                          "tf_tokens_per_step": round(expected_tokens_per_step(figures["slot_match"]), 3),
                          **figures})
        clock.maybe_save(both, optimizer)
    summary = {**clock.finish(both, optimizer), "draft_parameters": sum(p.numel() for p in draft.parameters()),
               "last": to_python(figures)}
    write_draft(folder / "model", recipe, target_cfg, draft.canonical_state_dict())
    # The target with its fine-tuned MTP head: the same trunk, so DFlash and MTP share one target.
    write_target(folder / "target", recipe, ids, target.canonical_state_dict(), tokenizer_dir)
    mark_done(folder, summary)
    log(f"{stage}: " + json.dumps(summary))
    return summary
