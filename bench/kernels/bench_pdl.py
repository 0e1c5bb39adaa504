"""Programmatic dependent launch (fast/kernels/common/pdl.py) on and off, over the draft's per-layer kernel chain.

The 35B-A3B draft's own Triton kernels at 8 rows (one request's block), as ``fast/model/draft.py``'s
``_layer`` runs them:

    skinny_linear    attention conv kernel projection [512, C] (split-K 8: the ticket counters)
    dynamic_conv     the attention conv's prepare side
    skinny_linear    q|k|v [3072, C] (split-K 4, the weight prefetched into L2 before the wait)
    draft_qk_norm_rope, ring_attention (split + merge, the window full)
    skinny_linear    o [C, 2048] (split-K 4, prefetched likewise)
    conv_finish_norm the attention conv's finish + residual + post-attention norm
    skinny_linear, dynamic_conv   the MLP conv's kernel projection and prepare side
    skinny_linear    gate|up with the SwiGLU epilogue [2 x 5632, C], down [C, 5632] (split-K 4)
    conv_finish_norm the MLP conv's finish + residual + the next layer's input norm

C = 2048, 16/4 heads of 128, conv taps 2 in groups of 16, W = 2048 (bench/shapes/qwen3.5-35b-a3b-dflash2).
The skinny projections use their H200_TUNED configs on any GPU. The chain is repeated for 8 layers, each
on its own weights and ring (~750 MB together, more than the L2), and captured as one CUDA graph, twice:
with PDL and without (``pdl.launch_settings``; a launch reads it when it is captured). Each
graph is timed by bench/measure.graph_replay_us (triton's do_bench median, L2 flushed between replays),
and its outputs must equal the other's bit for bit (PDL changes no arithmetic) with the ticket counters
all zero after the replays. Two variants: ``layer`` (with the q|k|v and o GEMMs, as the draft runs) and
``triton`` (those two GEMMs left out: a fixed q|k|v per layer and the attention output as o, so every boundary
is between two of our kernels). The saving per boundary is (off - on) over the PDL launches in the graph.
The selector's kernels run once per step, not per layer, and are left out. ``--configs-ab ROUNDS`` instead
times the ``layer`` chain with PDL on in three forms, in interleaved rounds: perf12's GEMM configs (q|k|v and
o in cuBLAS, no prefetch), the engine's configs with the prefetch off (``l2_prefetch=False``), and as the engine
runs (perf13: 531.7, 517.3 and 516.3 us for 8 layers).

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_pdl.py --out pdl.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from dflash2.bench.measure import capture_graph, graph_replay_us
from dflash2.fast.kernels.attention.attention_prologue import draft_qk_norm_rope_triton
from dflash2.fast.kernels.draft.conv_finish_norm import conv_finish_norm_triton
from dflash2.fast.kernels.draft.dynamic_conv import grouped_dynamic_conv_triton
from dflash2.fast.kernels.common.pdl import launch_settings, pdl_enabled
from dflash2.fast.kernels.draft.ring_attention import launch_plan, ring_attention_triton
from dflash2.fast.kernels.dense.skinny_linear import H200_TUNED, SkinnyConfig, skinny_linear_triton
from dflash2.fast.kernels.common.tickets import MAX_COUNTERS, ticket_counters

C, H, HKV, D, INTER, TAPS, GROUP, WINDOW, CAPACITY = 2048, 16, 4, 128, 5632, 2, 16, 2048, 2112
ROWS, LAYERS, EPS = 8, 8, 1e-6
ANCHOR = 5000  # the window full, wrapping the ring


def cuda_device() -> torch.device:
    """The current CUDA device with its index, as tensors carry it (tickets.py keys its buffers by it)."""
    return torch.device("cuda", torch.cuda.current_device())


def pdl_setting(on: bool):
    """PDL on or off for the launches inside (``pdl.launch_settings``; read at every launch)."""
    return launch_settings(pdl=on)


def prefetch_setting(on: bool):
    """The L2 prefetch on or off for the launches inside (``pdl.l2_prefetch_enabled``)."""
    return launch_settings(l2_prefetch=on)


def make_layers(gen: torch.Generator) -> list[dict]:
    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", generator=gen).mul_(k ** -0.5).bfloat16()

    def norm(n: int) -> torch.Tensor:  # Qwen3's norms scale by the stored weight: around 1
        return 1 + 0.1 * torch.randn(n, device="cuda", generator=gen)

    def base() -> torch.Tensor:  # [2 sides, K taps, C]
        return torch.randn(2, TAPS, C, device="cuda", generator=gen).mul_(0.5).bfloat16()

    def ring() -> torch.Tensor:
        return torch.randn(1, CAPACITY, HKV, D, device="cuda", generator=gen).bfloat16()

    return [dict(attn_kp=weight(2 * TAPS * C // GROUP, C), attn_base=base(), qkv=weight((H + 2 * HKV) * D, C),
                 q_norm=norm(D), k_norm=norm(D), ring_k=ring(), ring_v=ring(), o=weight(C, H * D), post_norm=norm(C),
                 mlp_kp=weight(2 * TAPS * C // GROUP, C), mlp_base=base(), gate_up=weight(2 * INTER, C),
                 down=weight(C, INTER), next_norm=norm(C),
                 static_qkv=torch.randn(ROWS, H + 2 * HKV, D, device="cuda", generator=gen).bfloat16())
            for _ in range(LAYERS)]


# (N, K, swiglu) -> config: the draft's GEMMs as main ran them before perf13 (q|k|v and o in cuBLAS, no prefetch)
PERF12_CONFIGS = {(2 * TAPS * C // GROUP, C, False): SkinnyConfig(block_n=16, block_k=128, split_k=8),
                  (INTER, C, True): SkinnyConfig(block_n=32, block_k=128),
                  (C, INTER, False): SkinnyConfig(block_n=32, block_k=128, split_k=4)}


def engine_configs() -> dict:
    """(N, K, swiglu) -> the config the engine's dispatch takes at 8 rows (H200_TUNED), None where it is cuBLAS."""
    shapes = [(2 * TAPS * C // GROUP, C, False), ((H + 2 * HKV) * D, C, False), (C, H * D, False), (INTER, C, True),
              (C, INTER, False)]
    return {shape: (H200_TUNED[shape][1] if shape in H200_TUNED and ROWS <= H200_TUNED[shape][0] else None)
            for shape in shapes}


def make_inputs(gen: torch.Generator) -> dict:
    angles = torch.rand(ROWS, D // 2, device="cuda", generator=gen) * 100
    return dict(x0=torch.randn(1, ROWS, C, device="cuda", generator=gen).bfloat16(),
                u0=torch.randn(1, ROWS, C, device="cuda", generator=gen).bfloat16(), cos=angles.cos(),
                sin=angles.sin())


def make_chain(layers: list[dict], gemms: bool, gen: torch.Generator, configs: dict | None = None,
               inputs: dict | None = None):
    """The 8-layer chain as a function of no arguments returning its outputs (for capture_graph).

    ``configs``: (N, K, swiglu) -> the skinny config of each GEMM, None for cuBLAS (default: ``engine_configs()``,
    what the draft runs); ``inputs``: the chain's x, u, cos and sin (default: drawn from ``gen``)."""
    configs = engine_configs() if configs is None else configs
    kp_cfg = configs[(2 * TAPS * C // GROUP, C, False)]
    gate_up_cfg, down_cfg = configs[(INTER, C, True)], configs[(C, INTER, False)]
    qkv_cfg, o_cfg = configs.get(((H + 2 * HKV) * D, C, False)), configs.get((C, H * D, False))
    inputs = make_inputs(gen) if inputs is None else inputs
    x0, u0, cos, sin = inputs["x0"], inputs["u0"], inputs["cos"], inputs["sin"]
    slots = torch.zeros(1, dtype=torch.long, device="cuda")
    anchor = torch.full((1,), ANCHOR, dtype=torch.long, device="cuda")

    def linear(a, w, cfg):
        return a @ w.T if cfg is None else skinny_linear_triton(a, w, config=cfg)

    def prepare(u, kp, base):
        delta = skinny_linear_triton(u.view(ROWS, C), kp, config=kp_cfg).view(1, ROWS, 2, TAPS, C // GROUP)
        return grouped_dynamic_conv_triton(u, base[0], delta[:, :, 0], GROUP), delta

    def layer(w, x, u):
        u, delta = prepare(u, w["attn_kp"], w["attn_base"])
        qkv = linear(u.view(ROWS, C), w["qkv"], qkv_cfg).view(ROWS, H + 2 * HKV, D) if gemms else w["static_qkv"]
        q, k = draft_qk_norm_rope_triton(qkv[:, :H], qkv[:, H:H + HKV], w["q_norm"], w["k_norm"], cos, sin, EPS)
        a = ring_attention_triton(q, k, qkv[:, H + HKV:], w["ring_k"], w["ring_v"], slots, anchor, WINDOW)
        o = (linear(a.view(ROWS, H * D), w["o"], o_cfg) if gemms else a.view(ROWS, H * D)).view(1, ROWS, C)
        x, u = conv_finish_norm_triton(o, w["attn_base"][1], delta[:, :, 1], GROUP, x, w["post_norm"], EPS,
                                       torch.bfloat16)
        u, delta = prepare(u, w["mlp_kp"], w["mlp_base"])
        act = skinny_linear_triton(u.view(ROWS, C), w["gate_up"], swiglu=True, config=gate_up_cfg)
        m = skinny_linear_triton(act, w["down"], config=down_cfg).view(1, ROWS, C)
        return conv_finish_norm_triton(m, w["mlp_base"][1], delta[:, :, 1], GROUP, x, w["next_norm"], EPS,
                                       torch.bfloat16)

    def chain():
        x, u = x0, u0
        outs = []
        for w in layers:
            x, u = layer(w, x, u)
            outs += [x, u]
        return outs

    return chain


def pdl_launches_per_layer() -> int:
    """Our kernels in one layer: the skinny GEMMs (4, and q|k|v and o where the engine takes the kernel for them),
    2 conv prepares, 2 finishes, the q/k prologue, the ring split and, where the plan splits the window, its merge."""
    merge = launch_plan(1, H, HKV, ROWS, D, WINDOW, cuda_device()).num_splits > 1
    skinny = sum(cfg is not None for cfg in engine_configs().values()) + 1  # the kernel projection runs twice
    return 6 + skinny + int(merge)


def replay_outputs(chain, on: bool) -> list[torch.Tensor]:
    """One capture of the chain with PDL on or off, replayed 3 times; its outputs after the last replay."""
    held = {}
    with pdl_setting(on):
        graph = capture_graph(lambda: held.__setitem__("outs", chain()))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in held["outs"]]


def bench_variant(name: str, chain, launches: int) -> dict:
    on_outs, off_outs = replay_outputs(chain, True), replay_outputs(chain, False)
    equal = all(torch.equal(a, b) for a, b in zip(on_outs, off_outs))
    times = {}
    for on in (False, True):
        with pdl_setting(on):
            times[on] = graph_replay_us(chain)
    zeros = bool((ticket_counters(cuda_device(), MAX_COUNTERS) == 0).all())
    saved = times[False] - times[True]
    print(f"{name}: PDL off {times[False]:8.2f} us, on {times[True]:8.2f} us ({LAYERS} layers; "
          f"{times[False] / LAYERS:6.2f} / {times[True] / LAYERS:6.2f} a layer), saved {saved:6.2f} us = "
          f"{saved / launches:5.3f} us per PDL launch ({launches}); outputs equal {equal}, counters zero {zeros}",
          flush=True)
    return {"variant": name, "us_off": times[False], "us_on": times[True], "layers": LAYERS,
            "pdl_launches": launches, "saved_us": saved, "saved_us_per_launch": saved / launches,
            "bitwise_equal": equal, "counters_zero": zeros}


def bench_configs(layers: list[dict], gen: torch.Generator, rounds: int) -> list[dict]:
    """PDL on, the layer chain with the GEMMs as main ran them before perf13 (PERF12_CONFIGS), with the engine's
    configs but the L2 prefetch off (``l2_prefetch=False``), and as the engine runs them, in interleaved rounds.
    The last two have the same tiles: their outputs must be equal bit for bit (a prefetch changes no value)."""
    inputs = make_inputs(gen)
    variants = {"perf12": (make_chain(layers, True, gen, PERF12_CONFIGS, inputs), True),
                "engine, prefetch off": (make_chain(layers, True, gen, None, inputs), False),
                "engine": (make_chain(layers, True, gen, None, inputs), True)}

    def timed(chain, prefetch):
        with prefetch_setting(prefetch):
            return graph_replay_us(chain)

    with pdl_setting(True):
        outs = {}
        for name, (chain, prefetch) in variants.items():
            with prefetch_setting(prefetch):
                outs[name] = replay_outputs(chain, True)
        equal = all(torch.equal(a, b) for a, b in zip(outs["engine, prefetch off"], outs["engine"]))
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (chain, prefetch) in variants.items():
                times[name].append(timed(chain, prefetch))
    rows = []
    for name, us in times.items():
        median = sorted(us)[len(us) // 2]
        print(f"{name}: {median:8.2f} us ({median / LAYERS:6.2f} a layer; rounds {' '.join(f'{t:.1f}' for t in us)})",
              flush=True)
        rows.append({"variant": name, "us": median, "rounds_us": us, "layers": LAYERS})
    print(f"the engine's outputs with and without the prefetch equal: {equal}", flush=True)
    rows.append({"variant": "bitwise", "prefetch_equal": equal, "engine_configs": {
        str(shape): (cfg.__dict__ if cfg else "cublas") for shape, cfg in engine_configs().items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--configs-ab", type=int, default=0, metavar="ROUNDS",
                        help="instead: the layer chain with perf12's GEMM configs against the engine's (PDL on)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl.py needs CUDA")
    start = time.perf_counter()
    with pdl_setting(True):
        enabled = pdl_enabled(cuda_device())
    if not enabled:
        print("PDL is not available here (compute capability < 9.0 or the interpreter): on equals off", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = make_layers(gen)
    if args.configs_ab:
        rows = bench_configs(layers, gen, args.configs_ab)
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__, "rows": rows,
                       "seconds": time.perf_counter() - start}, f, indent=1)
        if not rows[-1]["prefetch_equal"]:
            raise SystemExit("the L2 prefetch changed an output")
        return
    launches = LAYERS * pdl_launches_per_layer()
    rows = [bench_variant(name, make_chain(layers, gemms, gen), launches)
            for name, gemms in (("layer", True), ("triton", False))]
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "pdl_available": enabled, "rows": rows,
               "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if not all(r["bitwise_equal"] and r["counters_zero"] for r in rows):
        raise SystemExit("PDL changed an output or left a ticket counter set")


if __name__ == "__main__":
    main()
