"""Fused per-layer ops of the decode/verify step against the torch sequences they replace, beside the floor.

The fusions (fast/kernels/dense/rms_norm.py, gdn_prologue.py, attention_prologue.py, swiglu.py), each against its
torch twin (the model's torch form: the code path the CPU lane runs):

    add_rms_norm    h = x + y; rmsnorm(h)                   [N, C]          twin: kernels/dense/rms_norm.add_rms_norm_torch
    gated_rms_norm  rmsnorm(o) * w * silu(z)                [N, Hv, Dv]     twin: rms_norm.gated_rms_norm_torch
    gdn_prologue    conv + silu + l2norms + g, beta         decode/verify   twin: gdn_prologue.gdn_prologue_torch
                    (+ the conv state write, or the verify-input capture)
    qk_norm_rope    q/k head norms + RoPE + cast + K/V write                twin: attention_prologue.qk_norm_rope_torch
    output_gate     attn * sigmoid(gate)                                    twin: attention_prologue.output_gate_torch
    swiglu          silu(gate) * up of the gate|up GEMM     [N, 2I]         twin: swiglu.swiglu_act_torch
                    (its torch time: F.silu(gate) * up in bf16, the form it replaced)

at the released targets' shapes (bench/shapes/: Qwen3.5-27B C = 5120, GDN 16/48 heads of 128, conv
kernel 4, attention 24/4 heads of 256, rotary dim 64; Qwen3.5-35B-A3B C = 2048, GDN 16/32 heads,
attention 16/2 heads), bf16, N in {1, 8, 32} rows: decode (N sequences of one row) and, for the GDN
prologue, verify (N/8 sequences of 8 rows).

Per op: correctness of the fused kernel against the torch twin on fresh random data (rms-relative,
bf16 bound 2e-2; the state writes, the residual sum and the V copy EXACT), two fused calls bitwise
equal; device time per call from a CUDA graph of ``REPEAT`` back-to-back calls (graph replay: no
launch gaps, what a captured step pays) and eagerly (Python launch cost included); the floor (bytes
the op must move over the copy bandwidth measured here, read + write of a 1 GiB device copy); GPU
ops per call (kernels, memsets, copies) counted with the profiler, torch twin vs fused.

Per layer (27B, dense): one GDN and one attention decoder layer on dummy weights
(``FastDecoderLayer.forward_deferred``, at CONTEXT keys per sequence), the torch forms (the previous
code path: the dispatchers patched to their torch twins, and the GDN recurrence handed gathered,
zero-masked states) against the fused path: GPU ops per layer, graph-replay time per layer, and the
time of the layer's GEMMs alone (so ``layer - gemm`` is the non-GEMM time: the fused ops, the
recurrence, paged attention, SwiGLU's activation), with the projected per-step saving over
48 GDN + 16 attention layers. The layer outputs of both paths are compared (bf16 bound).

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_fusions.py --out result.json   # from the repo root
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback

import torch
import triton

from dflash2.fast.kernels.attention.attention_prologue import output_gate_torch, output_gate_triton, qk_norm_rope_triton
from dflash2.fast.kernels.gdn.gdn_prologue import gdn_prologue_triton
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_triton, gated_rms_norm_triton
from dflash2.fast.kernels.dense.swiglu import swiglu_act_triton
from dflash2.fast.kernels.attention.attention_prologue import output_gate, qk_norm_rope
from dflash2.fast.kernels.common.dispatch import forced_torch
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm, gated_rms_norm
from dflash2.fast.kernels.dense.swiglu import swiglu_act
from dflash2.fast.kernels.gdn.delta_rule import gdn_recurrence
from dflash2.fast.kernels.gdn.gdn_prologue import gdn_prologue
from dflash2.fast.model.batch import ForwardBatch
from dflash2.fast.kernels.gdn.gdn_prologue import gdn_prologue_torch
from dflash2.fast.model.layer import FastDecoderLayer
from dflash2.fast.kernels.dense.swiglu import swiglu_act_torch
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_torch, gated_rms_norm_torch
from dflash2.fast.model.params import Params
from dflash2.fast.model.pools import CachePools
from dflash2.fast.kernels.attention.attention_prologue import qk_norm_rope_torch
from dflash2.fast.kernels.attention.rope import rope_cos_sin
from dflash2.fast.model.step import StepMeta
from dflash2.reference.formats.config import load_target_config
from dflash2.reference.tiny.dummy import dummy_target_weights
from dflash2.reference.tiny.target import tiny_target_config
from dflash2.bench.measure import copy_bandwidth, rms_rel

MODELS = {"27b": "bench/shapes/qwen3.5-27b", "35b-a3b": "bench/shapes/qwen3.5-35b-a3b"}
ROWS = (1, 8, 32)
VERIFY_ROWS = 8  # rows per sequence of a verify step (k = 7 drafts)
CONTEXT = 512  # keys per sequence before the step (attention layers)
PAGE_SIZE = 16
PAGES_PER_SEQ = -(-(CONTEXT + VERIFY_ROWS) // PAGE_SIZE)
REPEAT = 20  # calls per captured graph
REPLAYS = 10
NOMINAL_BW = 4.25e12
BF16_BOUND = 2e-2
DT = torch.bfloat16
DEVICE = "cuda"
LAYERS_27B = (48, 16)  # GDN and attention layers of Qwen3.5-27B
COUNT_MODEL = "27b"  # GPU ops are counted (profiler) for this model's ops only: the counts do not depend on the shape


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def graph_us(fn, repeat: int = REPEAT) -> float:
    """Device microseconds per call: a CUDA graph of ``repeat`` calls, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (REPLAYS * repeat)


def eager_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def gpu_ops(fn) -> int:
    """Kernels, memsets and copies one call puts on the GPU (-1 where the profiler cannot trace)."""
    fn()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"profiler unavailable ({e}); GPU ops not counted")
        return -1
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def make_batch(num_seqs: int, rows: int) -> ForwardBatch:
    """``num_seqs`` sequences of ``rows`` rows after CONTEXT keys, pages laid out one after another."""
    pages = -(-(CONTEXT + rows) // PAGE_SIZE)
    width = triton.next_power_of_2(pages)
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    tables[:, :pages] = torch.arange(num_seqs * pages, dtype=torch.int32).view(num_seqs, pages)
    positions = torch.arange(CONTEXT, CONTEXT + rows).repeat(num_seqs)
    seq = torch.arange(num_seqs).repeat_interleave(rows)
    slots = tables.long()[seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    n, device = num_seqs * rows, DEVICE
    return ForwardBatch(
        token_ids=torch.zeros(n, dtype=torch.long, device=device), positions=positions.to(device),
        cu_seqlens=(torch.arange(num_seqs + 1) * rows).to(torch.int32).to(device),
        state_slots=torch.arange(num_seqs, device=device), kv_slot_mapping=slots.to(device),
        block_tables=tables.to(device), context_lens=torch.full((num_seqs,), CONTEXT + rows, device=device),
        is_verify=rows > 1, logits_rows=torch.arange(n, device=device), max_query_len=rows)


def swiglu_before(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch form the SwiGLU kernel replaced: ``F.silu(gate) * up`` in the model dtype (two kernels)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def op_row(model: str, op: str, step: str, rows: int, bytes_moved: int, bw: float, fused, twin, check) -> dict:
    """Time and count ``fused`` against ``twin`` (zero-argument callables); ``check()`` -> (errors, ok)."""
    errors, ok = check()
    row = {"model": model, "op": op, "step": step, "rows": rows, "bytes": bytes_moved,
           "floor_us": bytes_moved / bw * 1e6, "floor_nominal_us": bytes_moved / NOMINAL_BW * 1e6,
           "errors": errors, "ok": ok, "graph_us": graph_us(fused), "torch_graph_us": graph_us(twin),
           "eager_us": eager_us(fused), "torch_eager_us": eager_us(twin)}
    if model == COUNT_MODEL and (rows == ROWS[0] or step == "verify" and rows == ROWS[1]):  # the same at any N
        row["ops_fused"], row["ops_torch"] = gpu_ops(fused), gpu_ops(twin)
    row["fraction_of_floor"] = row["floor_us"] / row["graph_us"]
    return row


def bench_ops(model: str, cfg, bw: float, gen: torch.Generator) -> list[dict]:
    out = []
    c, eps = cfg.hidden_size, cfg.rms_norm_eps
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    cd, taps = cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(DEVICE)  # noqa: E731
    meta_pools = CachePools(tiny_target_config("tiny-dense"), ROWS[-1] * PAGES_PER_SEQ, PAGE_SIZE, num_slots=ROWS[-1],
                            max_verify_rows=VERIFY_ROWS, dtype=DT, device=DEVICE, mtp=False)
    for n in ROWS:
        # residual add + norm
        x, y, scale = rnd(n, c, scale=3).to(DT), rnd(n, c).to(DT), 1.0 + rnd(c, scale=0.1)

        def check_norm():
            h1, o1 = add_rms_norm_triton(x, y, scale, eps, DT)
            h2, o2 = add_rms_norm_torch(x, y, scale, eps, DT)
            again = add_rms_norm_triton(x, y, scale, eps, DT)[1]
            err = rms_rel(o1.float(), o2.float())
            return {"norm": err}, bool(torch.equal(h1, h2) and err <= BF16_BOUND and torch.equal(o1, again))
        out.append(op_row(model, "add_rms_norm", "any", n, 4 * n * c * 2 + 4 * c, bw,
                          lambda: add_rms_norm_triton(x, y, scale, eps, DT),
                          lambda: add_rms_norm_torch(x, y, scale, eps, DT), check_norm))

        # gated output norm, the gate read in place from the projection
        proj = rnd(n, cd + hv * dv + 2 * hv).to(DT)
        o, z, w = rnd(n, hv, dv), proj[:, cd:cd + hv * dv].view(n, hv, dv), 1.0 + rnd(dv, scale=0.1)

        def check_gated():
            a, b = gated_rms_norm_triton(o, z, w, eps, DT), gated_rms_norm_torch(o, z, w, eps, DT)
            err = rms_rel(a.float(), b.float())
            return {"gated": err}, bool(err <= BF16_BOUND and torch.equal(a, gated_rms_norm_triton(o, z, w, eps, DT)))
        out.append(op_row(model, "gated_rms_norm", "any", n, n * hv * dv * (4 + 2 + 2) + dv * 4, bw,
                          lambda: gated_rms_norm_triton(o, z, w, eps, DT),
                          lambda: gated_rms_norm_torch(o, z, w, eps, DT), check_gated))

        # GDN prologue: decode (n sequences x 1 row) and verify (n / 8 sequences x 8 rows)
        for step, seqs, per_seq in (("decode", n, 1), ("verify", n // VERIFY_ROWS, VERIFY_ROWS)):
            if seqs < 1:
                continue
            meta = StepMeta.build(make_batch(seqs, per_seq), meta_pools)
            conv_in, b, a = proj[:, :cd], proj[:, cd + hv * dv:cd + hv * dv + hv], proj[:, cd + hv * dv + hv:]
            states = rnd(ROWS[-1] + 1, cd, taps - 1).to(DT)  # the slots and the trash slot
            weight, neg_decay, dt_bias = rnd(cd, taps, scale=0.3).to(DT), -rnd(hv).abs() - 0.1, rnd(hv)
            verify = step == "verify"
            scratch = torch.full((seqs + 1, per_seq + 1, cd), float("nan"), dtype=DT, device=DEVICE)
            pools = {"fused": (states.clone(), scratch.clone()), "torch": (states.clone(), scratch.clone())}

            def run(which, fn, pools=pools, meta=meta, conv_in=conv_in, b=b, a=a, weight=weight, neg_decay=neg_decay,
                    dt_bias=dt_bias, verify=verify):
                st, sc = pools[which]
                return fn(conv_in, b, a, st, weight, neg_decay, dt_bias, meta, hk, dk, sc if verify else None)

            def check_gdn(states=states, scratch=scratch, run=run, pools=pools):
                for key in pools:
                    pools[key] = (states.clone(), scratch.clone())
                fused, twin = run("fused", gdn_prologue_triton), run("torch", gdn_prologue_torch)
                errors = {name: rms_rel(f.float(), t.float()) for name, f, t in zip("qkvgb", fused, twin)}
                ok = (all(e <= BF16_BOUND for e in errors.values()) and same(pools["fused"][0], pools["torch"][0])
                      and same(pools["fused"][1], pools["torch"][1]))
                return errors, bool(ok)
            state_bytes = seqs * cd * (taps - 1) * 2 * (1 if verify else 2)  # read; decode also writes it
            moved = (n * cd * 2 + n * 2 * hv * 2 + cd * taps * 2 + state_bytes + n * 2 * hk * dk * 4
                     + n * hv * dv * 2 + n * 2 * hv * 4 + (n * cd * 2 if verify else 0))
            out.append(op_row(model, "gdn_prologue", step, n, moved, bw,
                              lambda run=run: run("fused", gdn_prologue_triton),
                              lambda run=run: run("torch", gdn_prologue_torch), check_gdn))

        # attention prologue (+ K/V write) and output gate
        qkv = rnd(n, (2 * h + 2 * hkv) * d, scale=2).to(DT)
        positions = torch.randint(0, 4096, (n,), generator=gen).to(DEVICE)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        q_scale, k_scale = 1.0 + rnd(d, scale=0.1), 1.0 + rnd(d, scale=0.1)
        caches = {k: (torch.zeros(4 * n + 1, hkv, d, dtype=DT, device=DEVICE),
                      torch.zeros(4 * n + 1, hkv, d, dtype=DT, device=DEVICE)) for k in ("fused", "torch")}
        write_index = torch.randperm(4 * n, generator=gen)[:n].to(DEVICE)

        def prologue(which, fn, qkv=qkv, cos=cos, sin=sin, q_scale=q_scale, k_scale=k_scale, caches=caches,
                     write_index=write_index):
            kc, vc = caches[which]
            return fn(qkv, q_scale, k_scale, cos, sin, eps, h, hkv, kc, vc, write_index)

        def check_prologue(prologue=prologue, caches=caches, write_index=write_index):
            qf, qt = prologue("fused", qk_norm_rope_triton), prologue("torch", qk_norm_rope_torch)
            (kf, vf), (kt, vt) = caches["fused"], caches["torch"]
            errors = {"q": rms_rel(qf.float(), qt.float()), "k": rms_rel(kf[write_index].float(),
                                                                         kt[write_index].float())}
            ok = all(e <= BF16_BOUND for e in errors.values()) and torch.equal(vf, vt)
            return errors, bool(ok and torch.equal(qf, prologue("fused", qk_norm_rope_triton)))
        out.append(op_row(model, "qk_norm_rope", "any", n, 2 * n * (h + 2 * hkv) * d * 2 + 2 * n * d * 4, bw,
                          lambda prologue=prologue: prologue("fused", qk_norm_rope_triton),
                          lambda prologue=prologue: prologue("torch", qk_norm_rope_torch), check_prologue))

        attn = rnd(n, h, d).to(DT)
        gate = qkv[:, :2 * h * d].view(n, h, 2 * d)[..., d:]

        def check_gate(attn=attn, gate=gate):
            a, b = output_gate_triton(attn, gate), output_gate_torch(attn, gate)
            err = rms_rel(a.float(), b.float())
            return {"gate": err}, bool(err <= BF16_BOUND)
        out.append(op_row(model, "output_gate", "any", n, 3 * n * h * d * 2, bw,
                          lambda attn=attn, gate=gate: output_gate_triton(attn, gate),
                          lambda attn=attn, gate=gate: output_gate_torch(attn, gate), check_gate))

        # SwiGLU activation of the gate|up GEMM output (the dense MLP's width, else the shared expert's)
        width = cfg.intermediate_size or cfg.shared_expert_intermediate_size
        gate_up = rnd(n, 2 * width, scale=2).to(DT)

        def check_swiglu(gate_up=gate_up):
            a, b = swiglu_act_triton(gate_up), swiglu_act_torch(gate_up)
            err = rms_rel(a.float(), b.float())
            return {"swiglu": err}, bool(err <= BF16_BOUND and torch.equal(a, swiglu_act_triton(gate_up)))
        out.append(op_row(model, "swiglu", "any", n, 3 * n * width * 2, bw,
                          lambda gate_up=gate_up: swiglu_act_triton(gate_up),
                          lambda gate_up=gate_up: swiglu_before(gate_up), check_swiglu))
    return out


@contextlib.contextmanager
def torch_forms():
    """The fused ops sent to their torch twins: the code path before the fused kernels (the swiglu's
    twin replaced by the two-rounding form it fused, ``swiglu_before``).

    The GDN recurrence's torch form gathers the starting states and hands them to the gated delta rule
    (still the Triton recurrence), which turns off the in-place read of the slot pool, as before.
    """
    ops = [add_rms_norm, gated_rms_norm, gdn_prologue, gdn_recurrence, qk_norm_rope, output_gate, swiglu_act]
    twin = swiglu_act.torch_form
    swiglu_act.torch_form = swiglu_before
    try:
        with forced_torch(ops):
            yield
    finally:
        swiglu_act.torch_form = twin


def bench_layers(model: str, cfg, gen: torch.Generator) -> list[dict]:
    """One GDN and one attention layer (dense model only), torch forms vs fused."""
    params = Params(cfg, dummy_target_weights(cfg, device=DEVICE), DT, DEVICE)
    first = {kind: cfg.layer_types.index(kind) for kind in ("linear_attention", "full_attention")}
    layers = {kind: FastDecoderLayer(cfg, params, f"layers.{i}.", kind) for kind, i in first.items()}
    max_seqs = ROWS[-1]
    pools = CachePools(cfg, max_seqs * PAGES_PER_SEQ, PAGE_SIZE, num_slots=max_seqs, max_verify_rows=VERIFY_ROWS,
                       max_verify_seqs=max_seqs // VERIFY_ROWS, dtype=DT, device=DEVICE, mtp=False)
    out = []
    for step, n in [("decode", n) for n in ROWS] + [("verify", n) for n in ROWS if n >= VERIFY_ROWS]:
        per_seq = 1 if step == "decode" else VERIFY_ROWS
        meta = StepMeta.build(make_batch(n // per_seq, per_seq), pools)
        x = (torch.randn(n, cfg.hidden_size, generator=gen) * 0.5).to(DEVICE).to(DT)
        pending = (torch.randn(n, cfg.hidden_size, generator=gen) * 0.5).to(DEVICE).to(DT)
        for kind, layer in layers.items():
            state = pools.attention[first[kind]] if kind == "full_attention" else pools.gdn[first[kind]]
            def fn(layer=layer, state=state, meta=meta, x=x, pending=pending):
                return layer.forward_deferred(x, pending, meta, state)
            row = {"model": model, "layer": kind, "step": step, "rows": n}
            stored = ([state.key_storage, state.value_storage] if kind == "full_attention"
                      else [state.conv_storage, state.recurrent_storage])  # a decode step moves these on
            saved = [t.clone() for t in stored]
            try:
                fused_out = fn()
                for t, before in zip(stored, saved):
                    t.copy_(before)
                count = n == (1 if step == "decode" else VERIFY_ROWS)  # the same at any N
                with torch_forms():
                    torch_out = fn()
                    row["torch_graph_us"] = graph_us(fn, repeat=3)
                    if count:
                        row["ops_torch"] = gpu_ops(fn)
                row["errors"] = {"residual": rms_rel(fused_out[0].float(), torch_out[0].float()),
                                 "update": rms_rel(fused_out[1].float(), torch_out[1].float())}
                row["ok"] = all(e <= BF16_BOUND for e in row["errors"].values())
                row["graph_us"] = graph_us(fn, repeat=3)
                if count:
                    row["ops_fused"] = gpu_ops(fn)
                row["gemm_us"] = graph_us(gemms(layer, x), repeat=3)
            except Exception as e:  # noqa: BLE001 - a layer that fails is reported, the other results still come back
                row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            out.append(row)
            del saved
    return out


def gemms(layer: FastDecoderLayer, x: torch.Tensor):
    """A call of the layer's matmuls alone, at its shapes (the part of the layer the fusions leave as it is)."""
    mixer, mlp, n = layer.mixer, layer.mlp, x.shape[0]
    if layer.layer_type == "full_attention":
        w_in, w_out = mixer.w_qkv, mixer.w_o
    else:
        w_in, w_out = mixer.w_in, mixer.w_out
    mixed = torch.zeros(n, w_out.shape[1], dtype=x.dtype, device=x.device)
    act = torch.zeros(n, mlp.w_down.shape[1], dtype=x.dtype, device=x.device)

    def run():
        return x @ w_in.T, mixed @ w_out.T, x @ mlp.w_gate_up.T, act @ mlp.w_down.T
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--no-layers", action="store_true", help="skip the per-layer comparison")
    args = parser.parse_args()
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    configs = {model: load_target_config(path) for model, path in MODELS.items()}
    ops = [r for model, cfg in configs.items() for r in bench_ops(model, cfg, bw, gen)]
    layers = [] if args.no_layers else bench_layers("27b", configs["27b"], gen)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_bandwidth": bw, "nominal_bandwidth": NOMINAL_BW, "repeat": REPEAT,
              "ops": ops, "layers": layers, "all_ok": all(r["ok"] for r in ops + layers),
              "seconds": time.perf_counter() - start}

    print("per layer (27B, bf16; graph replay us; GPU ops per layer):")
    print(f"  {'layer':16s} {'step':6s} {'N':>3s} {'ops torch->fused':>16s} {'torch us':>9s} {'fused us':>9s} "
          f"{'gemm us':>8s} {'non-gemm torch->fused':>22s} ok")
    saving = {}
    for r in layers:
        if "error" in r:
            print(f"  {r['layer']:16s} {r['step']:6s} {r['rows']:3d} FAILED: {r['error']}")
            continue
        count = f"{r['ops_torch']:7d} -> {r['ops_fused']:<6d}" if "ops_fused" in r else " " * 17
        print(f"  {r['layer']:16s} {r['step']:6s} {r['rows']:3d} {count} "
              f"{r['torch_graph_us']:9.1f} {r['graph_us']:9.1f} {r['gemm_us']:8.1f} "
              f"{r['torch_graph_us'] - r['gemm_us']:10.1f} -> {r['graph_us'] - r['gemm_us']:<9.1f} "
              f"{'yes' if r['ok'] else 'NO'}")
        saving.setdefault((r["step"], r["rows"]), {})[r["layer"]] = r["torch_graph_us"] - r["graph_us"]
    for (step, n), by_kind in saving.items():
        if len(by_kind) == 2:
            ms = (LAYERS_27B[0] * by_kind["linear_attention"] + LAYERS_27B[1] * by_kind["full_attention"]) / 1e3
            result.setdefault("step_saving_ms", {})[f"{step}-{n}"] = ms
            print(f"  projected 27B {step} N={n}: {ms:.2f} ms less per step (48 GDN + 16 attention layers)")

    print(f"\n{result['device']}, copy bandwidth {bw / 1e12:.2f} TB/s (nominal {NOMINAL_BW / 1e12:.2f}); "
          f"{result['seconds']:.1f} s; all checks {'pass' if result['all_ok'] else 'FAIL'}")
    print(f"{'model':8s} {'op':15s} {'step':6s} {'N':>3s} {'floor':>6s} {'fused':>6s} {'%floor':>6s} {'torch':>7s} "
          f"{'x':>5s} {'eager':>6s} {'t-eager':>7s} {'ops':>7s} {'max err':>8s} ok   (us; graph replay per call)")
    for r in ops:
        count = f"{r['ops_torch']}->{r['ops_fused']}" if "ops_fused" in r else ""
        print(f"{r['model']:8s} {r['op']:15s} {r['step']:6s} {r['rows']:3d} {r['floor_us']:6.2f} {r['graph_us']:6.2f} "
              f"{100 * r['fraction_of_floor']:6.1f} {r['torch_graph_us']:7.2f} "
              f"{r['torch_graph_us'] / r['graph_us']:5.1f} "
              f"{r['eager_us']:6.1f} {r['torch_eager_us']:7.1f} {count:>7s} {max(r['errors'].values()):8.1e} "
              f"{'yes' if r['ok'] else 'NO'}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
