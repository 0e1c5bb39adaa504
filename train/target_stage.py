"""Stage ``target``: pre-train the small Qwen3.5 target and its MTP head on the corpus.

Per step, on windows x of ``seq_len + 1`` tokens (inputs ``x[:, :-1]``, labels ``x[:, 1:]``)::

    loss = CE(logits_t, x_{t+1})  +  mtp_loss_weight * CE(mtp_logits_t, x_{t+2})

The MTP head reads the pair (h_t, x_{t+1}) (h after the final norm, detached: the head learns to
read the target without pulling the target towards it) and predicts x_{t+2}, as served
(reference/model/mtp.py). AdamW (beta2 0.95, decoupled weight decay on matrices only), bf16
autocast, gradient clipping at 1; the time-budgeted schedule of ``schedule.py``. Held-out loss
(the target's next-token CE, nats per token) is measured on fixed held-out windows at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import TokenStream
from .export import target_config, write_target
from .model.target import TrainableTarget
from .recipe import Recipe
from .state import Progress, StageClock, done_summary, load_state, mark_done

SAVE_EVERY_S = 60.0
LOG_EVERY_S = 15.0


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices (ndim >= 2) only: norms, biases, gates and A_log keep theirs."""
    decay = [p for _, p in params if p.ndim >= 2]
    keep = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def target_losses(model: TrainableTarget, batch: torch.Tensor, mtp_weight: float) -> tuple[torch.Tensor, dict]:
    """The step's loss for ``batch [N, T+1]``, and its parts (detached tensors, read only when logging)."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    out = model(inputs)
    main = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
    loss, parts = main, {"loss": main.detach()}
    if model.mtp is not None and mtp_weight > 0:
        _, mtp_logits = model.mtp_forward(out.hidden[:, :-1].detach(), inputs[:, 1:])  # row t predicts x_{t+2}
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), labels[:, 1:].flatten())
        loss = loss + mtp_weight * mtp
        parts["mtp_loss"] = mtp.detach()
    return loss, parts


@torch.no_grad()
def heldout_loss(model: TrainableTarget, stream: TokenStream, device: torch.device, seq_len: int,
                 max_batches: int = 8, batch_size: int = 16) -> dict:
    """Mean next-token CE (nats/token) of the target, and of its MTP head, on fixed held-out windows."""
    model.eval()
    total, total_mtp, count, count_mtp = 0.0, 0.0, 0, 0
    for batch in stream.eval_batches(batch_size, seq_len, max_batches):
        batch = batch.to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(inputs)
            total += float(F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"))
            count += labels.numel()
            if model.mtp is not None:
                _, mtp_logits = model.mtp_forward(out.hidden[:, :-1], inputs[:, 1:])
                total_mtp += float(F.cross_entropy(mtp_logits.flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                   reduction="sum"))
                count_mtp += labels[:, 1:].numel()
    model.train()
    result = {"heldout_loss": total / count, "heldout_tokens": count}
    if count_mtp:
        result["heldout_mtp_loss"] = total_mtp / count_mtp
    return result


def train_target(run_dir: Path, recipe: Recipe, ids: dict, tokenizer_dir: Path, train: TokenStream,
                 heldout: TokenStream, device: torch.device, log=print) -> dict:
    """Run (or resume, or skip if done) the target stage; writes ``<run>/target/model`` and returns the summary."""
    folder = Path(run_dir) / "target"
    if (summary := done_summary(folder)) is not None:
        log(f"target: done earlier ({summary['steps']} steps, held-out loss {summary['heldout_loss']:.3f})")
        return summary
    budget = recipe.target_stage
    cfg = target_config(recipe, ids)
    torch.manual_seed(recipe.seed)
    model = TrainableTarget(cfg)
    model.init_weights(recipe.seed)
    model.to(device).train()
    optimizer = make_optimizer(list(model.named_parameters()), budget.lr, budget.weight_decay, device)
    progress = load_state(folder, model, optimizer) or Progress()
    if progress.step:
        log(f"target: resuming at step {progress.step} ({progress.elapsed_s:.0f} s of {budget.seconds:.0f} s done)")
    step_fn = torch.compile(target_losses) if recipe.compile else target_losses
    clock = StageClock(folder, "target", budget, progress, log, LOG_EVERY_S, SAVE_EVERY_S)
    while clock.running():
        lr = clock.set_learning_rate(optimizer)
        batch = train.train_batch(recipe.seed, progress.step, budget.batch_size, budget.seq_len).to(device,
                                                                                                  non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, parts = step_fn(model, batch, recipe.mtp_loss_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if clock.step_done(batch[:, :-1].numel()):
            clock.record({"lr": lr, "grad_norm": float(grad_norm), "tokens": progress.tokens,
                          "tokens_per_s": round(progress.tokens / max(progress.elapsed_s, 1e-9)),
                          **{name: round(float(v), 4) for name, v in parts.items()}})
        clock.maybe_save(model, optimizer)
    summary = {**clock.finish(model, optimizer), "parameters": sum(p.numel() for p in model.parameters()),
               **heldout_loss(model, heldout, device, budget.seq_len)}
    write_target(folder / "model", recipe, ids, model.canonical_state_dict(), tokenizer_dir)
    mark_done(folder, summary)
    log("target: " + json.dumps(summary))
    return summary
