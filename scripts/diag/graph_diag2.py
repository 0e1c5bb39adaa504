"""The law test's graphed_verifier, chunk by chunk, against eager verify_ragged on the same inputs."""
import sys, os
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "conformance/gpu"))
from dflash2.fast.speculative.proposer import DraftProposal
from dflash2.fast.speculative.verify import verify_ragged
from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.fast.engine.graphs.graph_step import graph_summary
from dflash2.reference.request.sampling_params import SamplingParams
import test_verifier_law_at_scale as law

dev = "cuda"
for batch in (64, law.CHUNK):
    case = law.GRAPHED
    run = law.graphed_verifier(case, batch, dev)
    logits, cand_ids, draft_probs, (temperature, top_k, top_p), anchors = law._fixed_inputs(case, batch, dev,
                                                                                            padding=law.GRAPH_PADDING)
    summary = graph_summary([case.params(), SamplingParams(temperature=0.0)])
    real = batch - law.GRAPH_PADDING
    draw = law.DraftSampler(5, dev)
    for chunk in range(3):
        new_drafts = draw(real)
        new_seeds = law.request_seeds(case, chunk * real, real, dev)
        a_g, e_g = run(new_drafts, new_seeds, real)
        a_g, e_g = a_g.clone(), e_g.clone()
        drafts = law.CANDS[:, 0].to(dev).expand(batch, law.DRAFTS).contiguous()
        seeds = torch.zeros(batch, dtype=torch.int64, device=dev)
        drafts[:real] = new_drafts
        seeds[:real] = new_seeds
        st = SamplingTensors(temperature, top_k, top_p, seeds, summary)
        out = verify_ragged(logits, DraftProposal(drafts, cand_ids, draft_probs), [law.DRAFTS] * batch, st, anchors)
        a_e, e_e = out.num_accepted[:real], out.emitted[:real]
        bad = (a_e != a_g) | (e_e != e_g).any(1)
        tally_g, tally_e = law.Tally(dev), law.Tally(dev)
        tally_g.add(a_g, e_g, new_drafts)
        tally_e.add(a_e, e_e, new_drafts)
        print(f"batch {batch} chunk {chunk}: graph!=eager {int(bad.sum())} of {real}; malformed graph "
              f"{int(tally_g.malformed)} eager {int(tally_e.malformed)}", flush=True)
        for i in bad.nonzero().flatten()[:4].tolist():
            print("   ", i, "drafts", new_drafts[i].tolist(), "eager", a_e[i].item(), e_e[i].tolist(), "graph",
                  a_g[i].item(), e_g[i].tolist())
