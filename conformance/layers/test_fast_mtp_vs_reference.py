"""The fast batched MTP head vs ``ReferenceMTP``, sequence by sequence, over the same pairs.

Three sequences of different lengths: their prompt pairs (target hidden at p, token at p+1) in
chunks of odd sizes over two steps (the second with a padding sequence), two chained steps that
read the MTP's own output hidden and a drafted token, then a rollback to a different position
per sequence (the reference truncates its cache; the fast head overwrites its paged rows and
shortens ``context_lens``) and more pairs. NUMERIC fp32 on logits and hidden. The MTP K/V pool
starts as NaN; padding writes nothing, and the MTP never touches the target's K/V.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.model.mtp import FastMTP
from dflash2.fast.model.pools import CachePools
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.tiny.target import write_tiny_target
from dflash2.reference.model.mtp import ReferenceMTP
from dflash2.reference.model.target import ReferenceTarget
from fast_model_harness import BOUNDS, REPORT, ErrorLog, Seq, changed_rows, make_batch, row_bytes, scattered_pages

PAGE_SIZE = 4
MAX_PAGES = 6
SEQ_LENS = (12, 6, 15)  # prompt tokens; the pairs are p = 0 .. len-2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def mtp_checkpoint(request, tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp(request.param), request.param, tokenizer=None)
    cfg, weights = load_target(path)
    return request.param, cfg, weights


@pytest.mark.parametrize("device", DEVICES)
def test_fast_mtp_fp32_matches_reference_per_sequence(mtp_checkpoint, device):
    preset, cfg, weights = mtp_checkpoint
    device = torch.device(device)
    target, reference = ReferenceTarget(cfg, weights), ReferenceMTP(cfg, weights)
    fast = FastMTP(cfg, weights, torch.float32, device)
    pools = CachePools(cfg, num_pages=24, page_size=PAGE_SIZE, num_slots=3, max_verify_rows=2,
                       dtype=torch.float32, device=device, poison=True)
    log = ErrorLog(f"NUMERIC fp32 {preset} MTP ({device})", BOUNDS[torch.float32])
    gen = torch.Generator().manual_seed(9)
    tokens = [torch.randint(0, cfg.vocab_size, (n + 6,), generator=gen) for n in SEQ_LENS]
    hidden = [target.forward(t).hidden for t in tokens]  # [n + 6, C] the target's final-normed rows
    pages = scattered_pages(3, MAX_PAGES, 24, seed=2)
    seqs = [Seq(slot, p, reference.new_cache()) for slot, p in enumerate(pages)]

    def step(pairs, pad_rows=0, positions_from=None):
        """pairs[b] = (hidden rows [T, C], next tokens [T]) of sequence b; compared per sequence."""
        batch = make_batch([(seq, toks) for seq, (_, toks) in zip(seqs, pairs)], PAGE_SIZE, MAX_PAGES, device,
                           pad_rows=pad_rows, positions_from=positions_from, host_max_query_len=False)
        rows = torch.cat([h for h, _ in pairs] + [torch.zeros(pad_rows, cfg.hidden_size)]).to(device)
        out = fast.forward(rows, batch, pools)
        start, last = 0, []
        for b, (seq, (h, toks)) in enumerate(zip(seqs, pairs)):
            if positions_from is not None:
                seq.cache.truncate(positions_from[b])
            ref = reference.forward(h, toks, seq.cache)
            span = slice(start, start + toks.shape[0])
            log.add("logits", out.logits[span], ref.logits)
            log.add("hidden", out.hidden[span], ref.hidden)
            seq.length = seq.cache.length
            last.append((out.hidden[span][-1:].cpu(), ref.hidden[-1:]))
            start += toks.shape[0]
        return batch, last

    def prompt_pairs(b, lo, hi):
        return hidden[b][lo:hi], tokens[b][lo + 1:hi + 1]

    step([prompt_pairs(b, 0, n) for b, n in enumerate((7, 3, 9))])
    before = {name: row_bytes(t) for name, t in (("k", pools.mtp.keys), ("v", pools.mtp.values))}
    target_kv = {layer: row_bytes(kv.keys) for layer, kv in pools.attention.items()}
    batch, last = step([prompt_pairs(b, lo, n - 1) for b, (lo, n) in enumerate(zip((7, 3, 9), SEQ_LENS))],
                       pad_rows=2)
    real_rows = set(batch.kv_slot_mapping[batch.kv_slot_mapping >= 0].tolist())
    for name, t in (("k", pools.mtp.keys), ("v", pools.mtp.values)):
        assert changed_rows(before[name], row_bytes(t)) == real_rows, name
    for layer, kv in pools.attention.items():
        assert changed_rows(target_kv[layer], row_bytes(kv.keys)) == set(), layer

    # chained drafting: the fast head reads its own hidden, the reference its own
    for _ in range(2):
        drafts = [torch.randint(0, cfg.vocab_size, (1,), generator=gen) for _ in seqs]
        chained = [(fast_h, d) for (fast_h, _), d in zip(last, drafts)]
        fast_batch = make_batch([(seq, d) for seq, d in zip(seqs, drafts)], PAGE_SIZE, MAX_PAGES, device)
        out = fast.forward(torch.cat([h for h, _ in chained]).to(device), fast_batch, pools)
        new_last = []
        for b, (seq, ((_, ref_h), d)) in enumerate(zip(seqs, zip(last, drafts))):
            ref = reference.forward(ref_h, d, seq.cache)
            log.add("logits", out.logits[b:b + 1], ref.logits)
            log.add("hidden", out.hidden[b:b + 1], ref.hidden)
            seq.length = seq.cache.length
            new_last.append((out.hidden[b:b + 1].cpu(), ref.hidden))
        last = new_last

    # rollback by a different amount per sequence, then the target's pairs again (overwriting rows)
    restart = [n - 1 + r for n, r in zip(SEQ_LENS, (0, 1, 2))]
    step([prompt_pairs(b, p, p + 2) for b, p in enumerate(restart)], positions_from=restart)
    step([prompt_pairs(b, p + 2, p + 3) for b, p in enumerate(restart)])

    unwritten = torch.ones(pools.num_kv_slots, dtype=torch.bool)
    unwritten[sorted({s for seq in seqs for s in seq.written})] = False
    assert pools.mtp.keys.cpu()[unwritten].isnan().all()
    REPORT.append(log)
    assert max(log.max_error.values()) <= log.bound, "\n".join(log.lines())
