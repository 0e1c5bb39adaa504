"""Greedy engine-like steps of the fast target, run the same way at tp=1 in-process and at tp=N by spawned ranks.

:func:`greedy_steps` drives one target through a prefill of every prompt in one batch, decode steps, a
verify step with its commit (keeping a different number of rows per sequence), and decode steps after it,
feeding each sequence's argmax back as its next token, and returns every step's logits, final hidden and taps
with the tokens chosen. :func:`rank_main` is one tensor-parallel rank: it joins a gloo group, builds the
fast target for its rank from the checkpoint and saves what :func:`greedy_steps` gives.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.target import FastTarget
from dflash2.fast.parallel import TPGroup
from dflash2.fast.speculative.commit import commit_verify
from dflash2.reference.formats.checkpoint import load_target
from fast_model_harness import Seq, make_batch, scattered_pages

PAGE_SIZE = 4
MAX_PAGES = 8
NUM_SLOTS = 3
SLOTS = (2, 0)
PROMPT_LENS = (9, 6)
DECODE_STEPS = 3
VERIFY_ROWS = 3  # anchor + 2 drafts
KEPT = (2, 3)  # rows each sequence keeps at the commit


def prompts(vocab_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in PROMPT_LENS]


def greedy_steps(target: FastTarget) -> dict[str, list[torch.Tensor]]:
    """Run the steps; returns per step ``logits [N, V]``, ``hidden [N, C]``, ``taps`` and ``tokens [B]``."""
    cfg = target.cfg
    pools = CachePools(target.local_cfg, num_pages=len(SLOTS) * MAX_PAGES, page_size=PAGE_SIZE, num_slots=NUM_SLOTS,
                       max_verify_rows=VERIFY_ROWS, dtype=target.dtype, device=target.device, mtp=False, poison=True)
    pages = scattered_pages(len(SLOTS), MAX_PAGES, len(SLOTS) * MAX_PAGES, seed=3)
    seqs = [Seq(slot, p) for slot, p in zip(SLOTS, pages)]
    out: dict[str, list[torch.Tensor]] = {"logits": [], "hidden": [], "taps": [], "tokens": []}

    def step(entries, is_verify=False):
        batch = make_batch(entries, PAGE_SIZE, MAX_PAGES, target.device, is_verify=is_verify)
        result = target.forward(batch, pools)
        for key in ("logits", "hidden", "taps"):
            out[key].append(getattr(result, key).detach().cpu().clone())
        return batch, result

    def advance(batch, logits, kept):
        """Each sequence moves on by its kept rows; its next token is the argmax at its last kept row."""
        ends = batch.cu_seqlens[:-1].long() + torch.tensor(kept) - 1
        tokens = logits[ends].argmax(dim=-1)
        for seq, k in zip(seqs, kept):
            seq.length += k
        out["tokens"].append(tokens.cpu())
        return tokens

    batch, result = step([(seq, p) for seq, p in zip(seqs, prompts(cfg.vocab_size))])
    tokens = advance(batch, result.logits, PROMPT_LENS)
    for _ in range(DECODE_STEPS):
        batch, result = step([(seq, tokens[i:i + 1]) for i, seq in enumerate(seqs)])
        tokens = advance(batch, result.logits, (1,) * len(seqs))
    drafts = [torch.stack([t, (t + 1) % cfg.vocab_size, (t + 2) % cfg.vocab_size]) for t in tokens]
    batch, result = step([(seq, d) for seq, d in zip(seqs, drafts)], is_verify=True)
    commit_verify(pools, batch, torch.tensor(KEPT), result.meta)
    tokens = advance(batch, result.logits, KEPT)
    for _ in range(DECODE_STEPS):
        batch, result = step([(seq, tokens[i:i + 1]) for i, seq in enumerate(seqs)])
        tokens = advance(batch, result.logits, (1,) * len(seqs))
    return out


def build(path: Path, tp: TPGroup | None = None) -> FastTarget:
    cfg, weights = load_target(path)
    return FastTarget(cfg, weights, torch.float32, "cpu", tap_layers=(0, cfg.num_hidden_layers - 2), tp=tp)


def rank_main(rank: int, size: int, port: int, path: str, out_dir: str) -> None:
    """One rank of a tp=``size`` group (torch.multiprocessing.spawn's entry): saves ``rank{rank}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        result = greedy_steps(build(Path(path), TPGroup.from_process_group()))
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
