"""GPU micro-benchmark: a GDN verify step and its commit (rollback by replay) at the released shapes.

Per model (bench/shapes/: Qwen3.5-35B-A3B, 30 GDN layers of Hv = 32 / Hk = 16 heads; Qwen3.5-27B, 48
layers of 48 / 16; Dk = Dv = 128, bf16) and B sequences of R = 8 rows (k = 7), device time from
CUDA-graph replays of:

- ``decode``: one layer's decode recurrence (B rows, the slots read and written in place), the
  baseline a verify row is compared with;
- ``verify``: one layer's verify recurrence (B x R rows from the slots, storing every row's k, v,
  g, beta into the verify scratch; no state written);
- ``commit``: the commit of every layer in one launch (fast/kernels/gdn/gdn_commit.py): the kept rows
  replayed on each slot's state in place, and the conv state shifted, at kept = R and kept = R/2.

Each beside its floor: the bytes it must move (states, row inputs, outputs, scratch) over the copy
bandwidth measured here. Check (EXACT), per B: verify then commit leaves in every slot bit for bit
the state a decode-style run of the kept rows gives (the same kernel arithmetic), and the conv state
equals the torch form's.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_gdn_verify.py --out r.json      # on the H200, < 60 s
    TRITON_INTERPRET=1 python3 bench/kernels/bench_gdn_verify.py --smoke            # CPU: the script's logic only
    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_gdn_verify.py --tiles --out t.json  # the state-tile sweep
    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_gdn_verify.py --prefill-rows 16,64,129,256,512 --out p.json
        # a prefill chunk by fla against the recurrence in place (where SHORT_PREFILL_ROWS should sit)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from dflash2.bench.measure import copy_bandwidth, cuda_time, graph_seconds, rms_rel
from dflash2.fast.kernels.gdn.gdn_commit import commit_verify_torch, commit_verify_triton
from dflash2.fast.kernels.gdn.gdn_recurrent import gated_delta_rule_verify_triton
from dflash2.fast.model.pools import GDNSlots, GDNStack
from dflash2.reference.formats.config import load_target_config

MODELS = {"35b-a3b": "bench/shapes/qwen3.5-35b-a3b", "27b": "bench/shapes/qwen3.5-27b"}
SEQS = (1, 4, 16)
ROWS = 8  # rows per sequence of a verify step
DT = torch.bfloat16


def row_inputs(cfg, rows: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k ``[N, Hk, Dk]`` fp32 (L2-normalised, q scaled), v ``[N, Hv, Dv]`` bf16, g, beta ``[N, Hv]`` fp32."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    q = F.normalize(rnd(rows, hk, dk), dim=-1) * dk ** -0.5
    return (q, F.normalize(rnd(rows, hk, dk), dim=-1), rnd(rows, hv, dv).to(DT), -F.softplus(rnd(rows, hv)),
            torch.sigmoid(rnd(rows, hv)))


def case(cfg, seqs: int, device: str, gen: torch.Generator) -> dict:
    layers = len(cfg.linear_attention_layers)
    stack = GDNStack(cfg, seqs, seqs, ROWS, DT, torch.device(device), poison=False)
    stack.recurrent_storage.copy_(torch.randn(stack.recurrent_storage.shape, generator=gen) * 0.1)
    stack.conv_storage.copy_(torch.randn(stack.conv_storage.shape, generator=gen).to(DT))
    index = torch.arange(seqs, device=device)
    return dict(stack=stack, slots=[GDNSlots(stack, i) for i in range(layers)], index=index,
                zero=torch.zeros(seqs, dtype=torch.bool, device=device),
                cu=torch.arange(seqs + 1, device=device, dtype=torch.int32) * ROWS,
                cu1=torch.arange(seqs + 1, device=device, dtype=torch.int32),
                verify=[row_inputs(cfg, seqs * ROWS, device, gen) for _ in range(layers)],
                decode=row_inputs(cfg, seqs, device, gen))


def verify_layer(c: dict, i: int) -> None:
    slots = c["slots"][i]
    gated_delta_rule_verify_triton(*c["verify"][i], slots.recurrent_storage, c["cu"], ROWS, state_index=c["index"],
                                   verify_rows=slots.verify_rows, output_final_state=False)


def commit(c: dict, kept: torch.Tensor, fn=commit_verify_triton) -> None:
    s = c["stack"]
    fn(s.conv_storage, s.recurrent_storage, s.verify_conv_inputs, s.verify_rows, c["index"], c["zero"], kept)


def check(c: dict, kept: torch.Tensor) -> bool:
    """Verify every layer, commit. The verify writes no state; each slot is then bit for bit a decode-style
    run of its kept rows from its pre-step state; the conv equals the torch form's (EXACT), the states its
    (NUMERIC fp32). The pools are put back as they were."""
    stack, seqs = c["stack"], kept.shape[0]
    states, convs = stack.recurrent_storage.clone(), stack.conv_storage.clone()
    for i in range(len(c["slots"])):
        verify_layer(c, i)
    ok = torch.equal(states, stack.recurrent_storage)
    commit(c, kept)
    twin_states, twin_convs = states.clone(), convs.clone()
    commit_verify_torch(twin_convs, twin_states, stack.verify_conv_inputs, stack.verify_rows, c["index"], c["zero"],
                        kept)
    ok &= torch.equal(stack.conv_storage, twin_convs) and rms_rel(stack.recurrent_storage, twin_states) <= 1e-5
    rows = torch.cat([torch.arange(int(n)) + b * ROWS for b, n in enumerate(kept.tolist())]).to(kept.device)
    cu = torch.cat([kept.new_zeros(1), kept.cumsum(0)]).to(torch.int32)
    for i, inputs in enumerate(c["verify"]):
        _, run = gated_delta_rule_verify_triton(*(t[rows] for t in inputs), states[i].clone(), cu, int(kept.max()),
                                                state_index=c["index"])
        ok &= torch.equal(stack.recurrent_storage[i, :seqs], run)
    stack.recurrent_storage.copy_(states)
    stack.conv_storage.copy_(convs)
    return bool(ok)


def bench(model: str, cfg, seqs: int, bw: float | None, device: str, gen: torch.Generator) -> dict:
    c = case(cfg, seqs, device, gen)
    layers = len(cfg.linear_attention_layers)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    state, cd, taps = hv * dk * dv * 4, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1
    row_in = 2 * hk * dk * 4 + hv * dv * 2 + 2 * hv * 4  # q, k fp32, v bf16, g, beta
    stored = hk * dk * 4 + hv * dv * 2 + 2 * hv * 4  # k, v, g, beta into the scratch
    kept = torch.randint(1, ROWS + 1, (seqs,), generator=gen).to(device)
    row = {"model": model, "seqs": seqs, "rows": ROWS, "layers": layers, "ok": check(c, kept)}
    floors = {"decode": seqs * (2 * state + row_in + hv * dv * 4),
              "verify": seqs * (state + ROWS * (row_in + hv * dv * 4 + stored))}
    for name, kept_rows in (("commit", ROWS), ("commit_half", ROWS // 2)):
        floors[name] = layers * seqs * (2 * state + kept_rows * stored + 2 * cd * taps * 2 + kept_rows * cd * 2)
    row["floor_bytes"] = floors
    if device != "cuda":
        return row
    full, half = torch.full((seqs,), ROWS, device=device), torch.full((seqs,), ROWS // 2, device=device)
    decode_rows = c["decode"]
    layer0 = c["slots"][0]
    calls = {
        "decode": lambda: gated_delta_rule_verify_triton(*decode_rows, layer0.recurrent_storage, c["cu1"], 1,
                                                         state_index=c["index"], output_final_state=False,
                                                         final_state_index=c["index"]),
        "verify": lambda: verify_layer(c, 0),
        "commit": lambda: commit(c, full),
        "commit_half": lambda: commit(c, half),
    }
    for name, fn in calls.items():
        us = graph_seconds(fn) * 1e6
        floor_us = floors[name] / bw * 1e6
        row[f"{name}_us"], row[f"{name}_floor_us"], row[f"{name}_fraction_of_floor"] = us, floor_us, floor_us / us
    row["step_us"] = layers * row["verify_us"] + row["commit_us"]  # every layer's verify + the commit, kept = R
    row["decode_step_us"] = layers * row["decode_us"]
    return row


TILES = ((32, 4), (32, 2), (16, 4), (16, 2), (16, 1), (8, 2), (8, 1), (64, 4), (64, 8))  # (block_v, num_warps)


def tile_sweep(cfg, seqs: int, device: str, gen: torch.Generator) -> list[dict]:
    """The state tile (``default_block_v``, ``NUM_WARPS``: shared by the recurrence and the commit, set in both
    modules here) swept at one model's shapes: device us for every GDN layer's verify (one graph, as a step
    runs them), every layer's decode, and the commit, with the EXACT check of :func:`check` per tile."""
    from dflash2.fast.kernels.gdn import gdn_commit
    from dflash2.fast.kernels.gdn import gdn_recurrent

    saved = (gdn_recurrent.NUM_WARPS, gdn_recurrent.default_block_v, gdn_commit.NUM_WARPS, gdn_commit.default_block_v)
    out = []
    try:
        for block_v, warps in TILES:
            tile = lambda dv, b=block_v: min(b, dv)  # noqa: E731
            gdn_recurrent.NUM_WARPS = gdn_commit.NUM_WARPS = warps
            gdn_recurrent.default_block_v = gdn_commit.default_block_v = tile
            c = case(cfg, seqs, device, gen)
            layers = len(c["slots"])
            kept = torch.randint(1, ROWS + 1, (seqs,), generator=gen).to(device)
            row = {"block_v": block_v, "num_warps": warps, "seqs": seqs, "ok": check(c, kept)}
            decode_rows, full = c["decode"], torch.full((seqs,), ROWS, device=device)

            def decode_all(c=c, decode_rows=decode_rows):
                for slots in c["slots"]:
                    gated_delta_rule_verify_triton(*decode_rows, slots.recurrent_storage, c["cu1"], 1,
                                                   state_index=c["index"], output_final_state=False,
                                                   final_state_index=c["index"])

            row["verify_us"] = graph_seconds(lambda c=c: [verify_layer(c, i) for i in range(layers)]) * 1e6 / layers
            row["decode_us"] = graph_seconds(decode_all) * 1e6 / layers
            row["commit_us"] = graph_seconds(lambda c=c, full=full: commit(c, full)) * 1e6
            print(f"tile block_v={block_v:3d} warps={warps}: verify {row['verify_us']:.2f} us/layer, decode "
                  f"{row['decode_us']:.2f} us/layer, commit {row['commit_us']:.1f} us, ok={row['ok']}", flush=True)
            out.append(row)
    finally:
        gdn_recurrent.NUM_WARPS, gdn_recurrent.default_block_v, gdn_commit.NUM_WARPS, gdn_commit.default_block_v = saved
    return out


def prefill_compare(cfg, rows_list: list[int], seqs_list: list[int], device: str, gen: torch.Generator) -> list[dict]:
    """One GDN layer's prefill chunk of B sequences x R rows (bf16 q, k, v), two ways: fla's chunked kernels
    (``gated_delta_rule_prefill_fla``, the gathered form: states gathered, final states returned) and the Triton
    recurrence in place (what ``delta_rule.SHORT_PREFILL_ROWS`` sends chunks of up to that many rows to). Per form:
    eager us between CUDA events (a call's launches and host work included: what a host-bound prefill step
    pays) and, for the recurrence, the device us of a graph replay; the two outputs' rms difference relative to
    fla's (NUMERIC bf16 class: fla's products are bf16 tensor-core ones)."""
    from dflash2.fast.kernels.gdn.gdn_prefill import fla_available, gated_delta_rule_prefill_fla

    out = []
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for seqs in seqs_list:
        for rows in rows_list:
            q, k, v, g, beta = row_inputs(cfg, seqs * rows, device, gen)
            q, k = q.to(DT), k.to(DT)
            pool = torch.randn(seqs, hv, dk, dv, generator=gen).to(device) * 0.1
            index = torch.arange(seqs, device=device)
            cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * rows
            work = pool.clone()

            def recurrence():
                return gated_delta_rule_verify_triton(q, k, v, g, beta, work, cu, rows, state_index=index,
                                                      output_final_state=False, final_state_index=index)[0]

            row = {"seqs": seqs, "rows": rows}
            o_rec = recurrence()
            work.copy_(pool)
            row["recurrence_eager_us"] = cuda_time(recurrence) * 1e6
            row["recurrence_graph_us"] = graph_seconds(recurrence) * 1e6
            if fla_available():
                o_fla, _ = gated_delta_rule_prefill_fla(q, k, v, g, beta, pool, cu, state_index=index)
                row["fla_eager_us"] = cuda_time(
                    lambda: gated_delta_rule_prefill_fla(q, k, v, g, beta, pool, cu, state_index=index)) * 1e6
                row["rms_rel_vs_fla"] = rms_rel(o_rec, o_fla)
            print(f"prefill B={seqs:2d} R={rows:4d}: recurrence in place {row['recurrence_eager_us']:8.1f} us eager, "
                  f"{row['recurrence_graph_us']:8.1f} us graph; fla {row.get('fla_eager_us', float('nan')):8.1f} us "
                  f"eager; rms rel {row.get('rms_rel_vs_fla', float('nan')):.1e}", flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): logic only")
    ap.add_argument("--tiles", action="store_true", help="only the state-tile sweep (TILES) at the 35B-A3B shapes")
    ap.add_argument("--prefill-rows", help="only the prefill comparison (prefill_compare) at the 35B-A3B shapes, "
                                           "at these comma-separated rows per sequence, 1 and 8 sequences")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.prefill_rows:
        if device != "cuda":
            raise SystemExit("--prefill-rows times CUDA kernels: run it on a GPU")
        rows_list = [int(r) for r in args.prefill_rows.split(",")]
        result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                  "prefill": prefill_compare(load_target_config(MODELS["35b-a3b"]), rows_list, [1, 8], device,
                                             torch.Generator().manual_seed(0))}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    if args.tiles:
        cfg = load_target_config(MODELS["35b-a3b"])
        sweep = {seqs: tile_sweep(cfg, seqs, device, torch.Generator().manual_seed(0)) for seqs in (1, 4)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                           "tiles": sweep}, f, indent=1)
        return
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    configs = {model: load_target_config(path) for model, path in MODELS.items()}
    seqs_list = SEQS
    if device == "cpu":  # two GDN layers of a few small heads
        configs = {"smoke": replace(configs["35b-a3b"], linear_num_key_heads=2, linear_num_value_heads=4,
                                    linear_key_head_dim=16, linear_value_head_dim=16,
                                    layer_types=("linear_attention", "linear_attention", "full_attention"),
                                    num_hidden_layers=3)}
        seqs_list = (2,)
    bw = copy_bandwidth() if device == "cuda" else None
    rows = [bench(model, cfg, seqs, bw, device, gen) for model, cfg in configs.items() for seqs in seqs_list]
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "copy_bandwidth": bw, "rows": rows, "all_ok": all(r["ok"] for r in rows),
              "seconds": time.perf_counter() - start}
    for r in rows:
        line = f"{r['model']:8s} B={r['seqs']:2d} x {r['rows']} rows, {r['layers']} layers: ok={r['ok']}"
        if "verify_us" in r:
            parts = [f"{name} {r[f'{name}_us']:.1f} us ({100 * r[f'{name}_fraction_of_floor']:.0f}% of floor)"
                     for name in ("decode", "verify", "commit", "commit_half")]
            line += f"\n    per layer: {parts[0]}, {parts[1]}; all layers: {parts[2]}, kept R/2: {parts[3]}"
            line += (f"\n    step: {r['layers']} verify layers + commit {r['step_us']:.0f} us, "
                     f"{r['layers']} decode layers {r['decode_step_us']:.0f} us")
        print(line)
    print(f"all checks {'pass' if result['all_ok'] else 'FAIL'}; {result['seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
