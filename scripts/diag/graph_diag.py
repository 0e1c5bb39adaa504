"""Captured vs eager verify_triton / filter_triton on identical inputs (the law test's toy)."""
import sys, os
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "conformance/gpu"))
from dflash2.fast.kernels.sampling.rejection import verify_triton, verify_torch
from dflash2.fast.kernels.sampling.row_filter import filter_triton
from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.fast.engine.graphs.graph_step import graph_summary
from dflash2.reference.request.sampling_params import SamplingParams
import test_verifier_law_at_scale as law

dev = "cuda"

def capture(fn):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out

for batch, pad in [(16, 7), (16, 0), (4096, 7), (1 << 18, 7), (1 << 18, 0)]:
    case = law.FILTERED
    logits, cand_ids, draft_probs, (temperature, top_k, top_p), anchors = law._fixed_inputs(case, batch, dev, padding=pad)
    summary = graph_summary([case.params(), SamplingParams(temperature=0.0)])
    seeds = law.request_seeds(case, 0, batch, dev).clone()
    drafts = law.DraftSampler(1, dev)(batch).contiguous()
    st = SamplingTensors(temperature, top_k, top_p, seeds, summary)
    a_e, e_e = verify_triton(logits, st, drafts, cand_ids, draft_probs, anchors)
    a_t, e_t = verify_torch(logits, st, drafts, cand_ids, draft_probs, anchors)
    flat = logits.reshape(-1, logits.shape[-1])
    f_e = filter_triton(flat, st, rows_per_request=3)
    g, (a_g, e_g) = capture(lambda: verify_triton(logits, st, drafts, cand_ids, draft_probs, anchors))
    g.replay(); torch.cuda.synchronize()
    fg, f_g = capture(lambda: filter_triton(flat, st, rows_per_request=3))
    fg.replay(); torch.cuda.synchronize()
    bad_eg = ((a_e != a_g) | (e_e != e_g).any(1)).sum().item()
    bad_et = ((a_e != a_t) | (e_e != e_t).any(1)).sum().item()
    fields = {}
    for name in ("row_max", "argmax", "cut_x", "cut_id", "z_kept"):
        x, y = getattr(f_e, name), getattr(f_g, name)
        fields[name] = int(((x != y) & ~(torch.isnan(x.double()) & torch.isnan(y.double()))).sum())
    print(f"batch {batch} pad {pad}: verify eager!=torch {bad_et}, eager!=graph {bad_eg}; filter eager!=graph {fields}",
          flush=True)
    if bad_eg:
        idx = ((a_e != a_g) | (e_e != e_g).any(1)).nonzero().flatten()
        print("  first bad requests", idx[:10].tolist(), "fraction", bad_eg / batch)
        for i in idx[:4].tolist():
            print("   ", i, a_e[i].item(), e_e[i].tolist(), a_g[i].item(), e_g[i].tolist())
        rows = (idx[:4, None] * 3 + torch.arange(3, device=dev)).flatten()
        for name in ("cut_x", "cut_id", "z_kept", "argmax"):
            print("    ", name, getattr(f_e, name)[rows].tolist(), getattr(f_g, name)[rows].tolist())
    del g, fg
