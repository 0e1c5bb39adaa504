"""GPU micro-benchmark: the target-distribution filter, sampling and verify at the released shapes.

V = 248320 fp32 logits rounded from bf16 (randn * 3, a few rows peaked on one token), drafts from
sparse q over K = 16 candidates of each row's noisy top-k. Every case is checked against its torch
twin on the same inputs (tokens, num_accepted: EXACT; filter cuts: the same kept set) and timed
twice: ``triton.testing.do_bench`` (median, eager launches) and a CUDA-graph replay of the same call.
Beside them: the floor (the logits' bytes read once at 4.25e12 B/s, and at the copy bandwidth
measured here) and the old path, the torch.sort-based ``filter_cuts`` this replaces, on the same rows.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_verify.py --out r.json     # on the H200, < 60 s
    TRITON_INTERPRET=1 python3 bench/kernels/bench_verify.py --smoke           # CPU: the script's logic only

scripts/gpu_check.sh makes the /tmp/pkg/dflash2/{reference,fast} symlinks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dflash2.fast.engine.sampling import sample_next
from dflash2.fast.kernels.sampling.rejection import verify_torch, verify_triton
from dflash2.fast.kernels.sampling.row_filter import filter_torch, filter_triton, kept_by_cut, scaled_logits
from dflash2.fast.kernels.sampling.sampler import SamplingTensors, sample_torch
from dflash2.reference.request.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.25e12  # the floor's bandwidth (project convention); the measured copy bandwidth is beside it
V, K, K_SEL = 248320, 7, 16
TOPK = dict(temperature=1.0, top_k=20, top_p=0.95)
TOPP = dict(temperature=1.0, top_p=0.95)


def make_logits(rows: int, vocab: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """randn * 3 rounded through bf16; every 5th row peaked: one token 8 above the row's max (p ~ 0.98, a
    confident target; the other rows are flat, their top-p 0.95 set ~20k tokens)."""
    logits = (torch.randn(rows, vocab, generator=gen, device=device) * 3).to(torch.bfloat16).float()
    peaked = torch.arange(0, rows, 5, device=device)
    logits[peaked, (peaked * 7919) % vocab] = logits[peaked].max(dim=-1).values + 8.0
    return logits


def make_drafts(logits: torch.Tensor, batch: int, k: int, gen: torch.Generator):
    """Sparse q over the top K_SEL of the target's logits plus noise, drafts drawn from q."""
    device = logits.device
    rows = logits.reshape(batch, k + 1, -1)[:, :k]
    noisy = rows + 0.5 * torch.randn(rows.shape, generator=gen, device=device)
    cand_ids = torch.topk(noisy, K_SEL, dim=-1).indices  # [B, k, K]
    draft_probs = torch.softmax(noisy.gather(-1, cand_ids), dim=-1)
    picks = torch.multinomial(draft_probs.reshape(-1, K_SEL), 1, generator=gen).reshape(batch, k)
    drafts = cand_ids.gather(-1, picks[..., None])[..., 0]
    anchors = torch.arange(batch, device=device) * 37 + 5
    return drafts, cand_ids, draft_probs, anchors


def old_filter_cuts(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The replaced cut finder: softmax and a stable torch.sort of every row (the seed of this rewrite)."""
    vocab = logits.shape[-1]
    greedy = st.greedy
    filtered = ~greedy & ((st.top_k != -1) | (st.top_p < 1.0))
    x = logits.float() / torch.where(greedy, torch.ones_like(st.temperature), st.temperature)[:, None]
    probs = torch.softmax(x, dim=-1)
    neg_sorted, order = torch.sort(-probs, dim=-1, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    keep = (st.top_k[:, None] == -1) | (rank[None, :] < st.top_k[:, None])
    masked = -neg_sorted * keep
    masked = masked / masked.sum(dim=-1, keepdim=True)
    keep &= ((torch.cumsum(masked, dim=-1) - masked) < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
    cut_id = order.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)
    cut_x = x.gather(-1, cut_id)[:, 0]
    return torch.where(filtered, cut_x, float("-inf")), torch.where(filtered, cut_id[:, 0], vocab - 1)


class Timer:
    """do_bench (median) and CUDA-graph replay on CUDA; wall clock over a few calls on CPU (--smoke)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def eager_us(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3

    def graph_us(self, fn) -> float | None:
        if not self.cuda:
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / reps


def copy_bandwidth(device: str) -> float | None:
    """Bytes moved (read + write) per second by a 512 MiB device-to-device copy."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 27, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    import triton.testing
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=40, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def same_kept(logits: torch.Tensor, st: SamplingTensors, rows_per_request: int) -> bool:
    """The sort-free filter keeps exactly the tokens its torch twin keeps (sampled rows)."""
    fast, twin = filter_triton(logits, st, rows_per_request), filter_torch(logits, st, rows_per_request)
    x, greedy = scaled_logits(logits, st, rows_per_request)
    same = (kept_by_cut(x, fast.cut_x, fast.cut_id) == kept_by_cut(x, twin.cut_x, twin.cut_id)).all(dim=-1)
    return bool((same | greedy).all() and torch.equal(fast.argmax, twin.argmax))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny vocabulary on CPU (Triton interpreter): logic only")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    vocab = 301 if device == "cpu" else V
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    t_start = time.perf_counter()
    floor_bw = copy_bandwidth(device)

    cases: list[dict] = []
    exact = True

    def record(name: str, rows: int, fast_fn, check: bool, old_fn=None):
        nonlocal exact
        exact &= check
        logits_bytes = rows * vocab * 4
        entry = dict(case=name, rows=rows, exact=check, eager_us=timer.eager_us(fast_fn),
                     graph_us=timer.graph_us(fast_fn), floor_us=logits_bytes / HBM_BYTES_PER_S * 1e6,
                     floor_measured_us=None if floor_bw is None else logits_bytes / (floor_bw / 2) * 1e6)
        if old_fn is not None:
            entry["old_filter_cuts_us"] = timer.eager_us(old_fn)
        cases.append(entry)
        print(f"{name:42s} exact={check} eager {entry['eager_us']:9.1f} us  graph "
              f"{entry['graph_us'] if entry['graph_us'] is None else round(entry['graph_us'], 1)} us", flush=True)

    for name, batch, kinds in [("verify 4 req k=7 top-k 20 top-p 0.95", 4, [TOPK]),
                               ("  the same, no host summary (graphs)", 4, [TOPK]),
                               ("verify 4 req k=7 top-k off top-p 0.95", 4, [TOPP]),
                               ("verify 4 req k=7 greedy", 4, [dict(temperature=0.0)]),
                               ("verify 16 req k=7 top-k 20 top-p 0.95", 16, [TOPK]),
                               ("verify 16 req k=7 mixed", 16, [TOPK, dict(temperature=0.0), dict(temperature=0.7),
                                                               TOPP])]:
        params = [SamplingParams(seed=1000 + b, **kinds[b % len(kinds)]) for b in range(batch)]
        st = SamplingTensors.from_params(params, device=device)
        if "no host summary" in name:  # what a graph over static parameter buffers sees: every launch runs
            st = SamplingTensors(st.temperature, st.top_k, st.top_p, st.seeds)
        logits = make_logits(batch * (K + 1), vocab, gen, device)
        drafts, cand_ids, draft_probs, anchors = make_drafts(logits, batch, K, gen)
        inputs = (logits, st, drafts, cand_ids, draft_probs, anchors)
        got, want = verify_triton(*inputs), verify_torch(*inputs)
        check = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if not st.all_greedy:
            check &= same_kept(logits, st, K + 1)
        rows_st = st.repeat_rows(K + 1)
        record(name, batch * (K + 1), lambda: verify_triton(*inputs), check,
               None if st.all_greedy else (lambda: old_filter_cuts(logits, rows_st)))
        cases[-1]["accepted_mean"] = float(want[0].float().mean())
        if name.startswith("verify 4 req k=7 top-k"):  # its share: the cut finder alone on the same rows
            record("  of which filter_triton", batch * (K + 1), lambda: filter_triton(logits, st, K + 1), check)

    for rows in (1, 16):
        for label, kind in [("top-k 20 top-p 0.95", TOPK), ("T=0.7", dict(temperature=0.7)),
                            ("greedy", dict(temperature=0.0))]:
            params = [SamplingParams(seed=7 + r, **kind) for r in range(rows)]
            st = SamplingTensors.from_params(params, device=device)
            logits = make_logits(rows, vocab, gen, device)
            positions = torch.arange(rows, device=device) + 100
            check = torch.equal(sample_next(logits, st, positions), sample_torch(logits, st, positions))
            if not st.all_greedy:
                check &= same_kept(logits, st, 1)
            record(f"sample_next {rows} row(s) {label}", rows, lambda: sample_next(logits, st, positions), check,
                   None if st.all_greedy else (lambda: old_filter_cuts(logits, st)))

    elapsed = time.perf_counter() - t_start
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  vocab=vocab, k=K, k_sel=K_SEL, floor_bandwidth=HBM_BYTES_PER_S, copy_bandwidth=floor_bw,
                  exact=exact, seconds=elapsed, cases=cases, command=" ".join(sys.argv))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def cell(value: float | None, width: int) -> str:
        return f"{'-':>{width}s}" if value is None else f"{value:{width}.1f}"

    # verify rows last: scripts/gpu_check.sh shows a log's last 12 lines
    print(f"\n{'case':42s} {'eager us':>9s} {'graph us':>9s} {'floor us':>9s} {'x floor':>8s} {'old cuts us':>12s}")
    for c in sorted(cases, key=lambda c: c["case"].startswith(("verify", " "))):
        best = c["graph_us"] if c["graph_us"] is not None else c["eager_us"]
        print(f"{c['case']:42s} {cell(c['eager_us'], 9)} {cell(c['graph_us'], 9)} {cell(c['floor_us'], 9)} "
              f"{cell(best / c['floor_us'], 8)} {cell(c.get('old_filter_cuts_us'), 12)}")
    bw = "n/a" if floor_bw is None else f"{floor_bw / 1e12:.2f} TB/s"
    print(f"V={vocab}  copy bandwidth {bw}  floor at 4.25e12 B/s  all exact vs the torch twin: {exact}  "
          f"({elapsed:.1f} s)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
