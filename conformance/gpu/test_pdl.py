"""Programmatic dependent launch (fast/kernels/common/pdl.py) for the draft's own Triton kernels.

1. Off where it cannot run: on the CPU, under Triton's interpreter, and when the launch settings say so; then the
   launch options are empty (so nothing reaches the interpreter's launcher).
2. The rule, statically: every Triton kernel under fast/kernels/ with a ``PDL`` parameter starts (after
   its docstring) with ``if PDL: gdc_wait(); gdc_launch_dependents()``, before any load or store.
3. EXACT, on a Hopper GPU: split-K skinny_linear (the shared ticket counters) and conv_finish_norm back to
   back, as a draft layer runs them, captured in one CUDA graph with PDL and one without: replays equal
   each other and the eager calls bit for bit, every time, and the counters are all zero after.

This file sits here rather than in conformance/ops/ because PDL is no kernel twin of the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dflash2.fast.kernels.common import pdl
from dflash2.fast.kernels.draft.conv_finish_norm import conv_finish_norm_triton
from dflash2.fast.kernels.dense.skinny_linear import SkinnyConfig, skinny_linear_triton
from dflash2.fast.kernels.common.tickets import MAX_COUNTERS, ticket_counters

KERNEL_DIR = Path(__file__).resolve().parents[2] / "fast" / "kernels"


@pytest.fixture
def fresh_cache():
    """pdl's per-device cache emptied around a test that changes what it read."""
    pdl._supported.cache_clear()
    yield
    pdl._supported.cache_clear()


def test_off_on_the_cpu():
    assert not pdl.pdl_enabled("cpu")
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options("cpu") == {}


def test_off_when_the_settings_say_so():
    with pdl.launch_settings(pdl=False, l2_prefetch=False):  # read before the device is looked at: no CUDA needed
        assert not pdl.pdl_enabled(torch.device("cuda", 0))
        assert not pdl.l2_prefetch_enabled(torch.device("cuda", 0))
        assert pdl.launch_options(torch.device("cuda", 0)) == {}
    assert pdl.SETTINGS == pdl.LaunchSettings()  # restored


def test_off_under_the_interpreter(monkeypatch, fresh_cache):
    monkeypatch.setattr(pdl, "INTERPRETED", True)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def _is_gdc_call(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and ast.unparse(stmt.value.func) == f"tl.extra.cuda.{name}")


def _wait_block(stmt: ast.stmt) -> bool:
    """``if PDL: gdc_wait(); gdc_launch_dependents()``, nothing else."""
    return (isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "PDL" and not stmt.orelse
            and len(stmt.body) >= 2 and _is_gdc_call(stmt.body[-2], "gdc_wait")
            and _is_gdc_call(stmt.body[-1], "gdc_launch_dependents"))


def _follows_early_rule(fn: ast.FunctionDef) -> bool:
    """An early reader (pdl.EARLY_READERS): one ``if PDL:`` block ending in the wait and the trigger, anywhere
    in the body, and no store or atomic before that wait in the source (an ``atomic_add`` of 0, a counter's
    read, is not a write)."""
    waits = [node for node in ast.walk(fn) if isinstance(node, ast.If) and _wait_block(node)]
    if len(waits) != 1:
        return False
    wait_line = waits[0].body[-2].lineno

    def reads_only(call: ast.Call) -> bool:
        return (ast.unparse(call.func) == "tl.atomic_add" and len(call.args) >= 2
                and isinstance(call.args[1], ast.Constant) and call.args[1].value == 0)
    writes = [node for node in ast.walk(fn) if isinstance(node, ast.Call)
              and (ast.unparse(node.func) == "tl.store"
                   or (ast.unparse(node.func).startswith("tl.atomic") and not reads_only(node)))]
    return all(node.lineno > wait_line for node in writes)


def pdl_kernels(directory: Path = KERNEL_DIR, early: dict | None = None) -> dict[str, bool]:
    """``module:kernel`` -> whether it follows the rule, for every jit function with a ``PDL`` parameter:
    the wait and the trigger first (after the docstring), or for an early reader the exception's form."""
    early = pdl.EARLY_READERS if early is None else early
    found = {}
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or "PDL" not in [a.arg for a in node.args.args]:
                continue
            name = f"{path.stem}:{node.name}"
            if name in early:
                found[name] = _follows_early_rule(node)
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            found[name] = bool(body) and _wait_block(body[0]) and len(body[0].body) == 2
    return found


def test_every_pdl_kernel_waits_first():
    kernels = pdl_kernels()
    assert set(kernels) == {
        "skinny_linear:_skinny_linear_kernel", "ring_attention:_ring_split_kernel",
        "ring_attention:_ring_merge_kernel", "dynamic_conv:_grouped_dynamic_conv_kernel",
        "conv_finish_norm:_conv_finish_norm_kernel", "attention_prologue:_draft_qk_norm_rope_kernel",
        "selector:_block_topk_kernel", "selector:_merge_topk_kernel", "selector:_project_kernel",
        "selector:_walk_kernel",
        "moe:_moe_expert_tile_kernel", "moe:_moe_gate_up_kernel", "moe:_moe_down_kernel", "moe:_moe_sum_kernel",
        "quant_matmul:_quant_matmul_kernel"}
    assert set(pdl.EARLY_READERS) <= set(kernels)
    assert [name for name, ok in kernels.items() if not ok] == []


def test_the_rule_check_catches_a_load_before_the_wait(tmp_path):
    (tmp_path / "rogue.py").write_text(
        "@triton.jit\ndef k(x_ptr, PDL: tl.constexpr):\n    x = tl.load(x_ptr)\n"
        "    if PDL:\n        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n")
    assert pdl_kernels(tmp_path) == {"rogue:k": False}


def test_the_early_rule_check_catches_a_store_before_the_wait(tmp_path):
    body = ("    x = tl.load(x_ptr)\n{}    if PDL:\n        tl.extra.cuda.gdc_wait()\n"
            "        tl.extra.cuda.gdc_launch_dependents()\n    tl.store(y_ptr, x)\n")
    head = "@triton.jit\ndef k(x_ptr, y_ptr, PDL: tl.constexpr):\n"
    (tmp_path / "early.py").write_text(head + body.format(""))
    (tmp_path / "rogue.py").write_text(head + body.format("    tl.store(y_ptr, x)\n"))
    early = {"early:k": "x is read-only", "rogue:k": "x is read-only"}
    assert pdl_kernels(tmp_path, early) == {"early:k": True, "rogue:k": False}


def _replays_equal_eager_with_and_without_pdl(monkeypatch, device, chain, after_replay=None) -> None:
    """For PDL on, then off (``pdl.launch_settings``): ``chain()`` (a list of output tensors) eagerly, then captured in a CUDA graph
    whose outputs are poisoned (NaN, or -1 for integers) before each of four replays; every replay must equal
    the eager outputs bit for bit (``after_replay(setting, replay)`` may check more), and the two settings
    must give the same bits."""
    results = {}
    for setting in ("1", "0"):
        with pdl.launch_settings(pdl=setting == "1"):
            assert pdl.pdl_enabled(device) == (setting == "1")
            eager = [t.clone() for t in chain()]  # compiles this setting's variants outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = chain()
        for replay in range(4):
            for t in captured:
                t.fill_(float("nan") if t.dtype.is_floating_point else -1)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, eager)), f"PDL={setting}: replay {replay} != eager"
            if after_replay is not None:
                after_replay(setting, replay)
        results[setting] = eager
    assert len(results["1"]) == len(results["0"])
    assert all(torch.equal(a, b) for a, b in zip(results["1"], results["0"])), "PDL changed the bits"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9.0")
def test_split_k_and_conv_finish_in_a_graph_are_exact_with_pdl(monkeypatch):
    """Three draft layers' worth of kernel projection (split-K 8) -> conv finish + norm -> a split-K 4 GEMM
    straight into another split-K 8 one (two ticket kernels back to back) -> conv finish + norm."""
    c, rows, taps, group = 2048, 8, 2, 16
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).bfloat16()

    x0, u0 = rand(1, rows, c), rand(1, rows, c)
    kp, w = rand(2 * taps * c // group, c, scale=c ** -0.5), rand(c, c, scale=c ** -0.5)
    base = rand(2, taps, c, scale=0.5)
    scale = 1 + 0.1 * torch.randn(c, device=device, generator=gen)
    kp_cfg, w_cfg = SkinnyConfig(block_n=16, block_k=128, split_k=8), SkinnyConfig(block_n=32, block_k=128, split_k=4)

    def chain():
        x, u, outs = x0, u0, []
        for _ in range(3):
            delta = skinny_linear_triton(u.view(rows, c), kp, config=kp_cfg).view(1, rows, 2, taps, c // group)
            x, u = conv_finish_norm_triton(u, base[1], delta[:, :, 1], group, x, scale, 1e-6, torch.bfloat16)
            m = skinny_linear_triton(u.view(rows, c), w, config=w_cfg)
            delta = skinny_linear_triton(m, kp, config=kp_cfg).view(1, rows, 2, taps, c // group)
            x, u = conv_finish_norm_triton(m.view(1, rows, c), base[1], delta[:, :, 1], group, x, scale, 1e-6,
                                           torch.bfloat16)
            outs += [delta, x, u]
        return outs

    counters = ticket_counters(device, MAX_COUNTERS)

    def counters_zero(setting, replay):
        assert int(counters.count_nonzero()) == 0, f"PDL={setting}: replay {replay} left a ticket counter set"

    _replays_equal_eager_with_and_without_pdl(monkeypatch, device, chain, counters_zero)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9.0")
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_moe_sublayers_in_a_graph_are_exact_with_pdl(monkeypatch, rows):
    """Three MoE sublayers at the 35B-A3B's widths (C = 2048, I = 512, 64 experts + the shared one, k = 8) as a
    verify (8 or 16 rows: the overlapped split form, its down kernel reading the router's ids before its wait and
    h once its expert's counter is full, beside the gate/up kernel) or a decode (1 row: the fused form) runs them:
    the router's kernels, then the experts', each layer's ids fresh from its router, one counter buffer for all
    (the model's is one a layer). PDL on and off: every replay equals the eager calls bit for bit, both give
    the same bits, and the counters are left zero."""
    from dflash2.fast.kernels.moe.moe import default_blocks, moe_experts_triton
    from dflash2.fast.kernels.moe.moe_router import route_triton

    c, width, experts, top_k = 2048, 512, 64, 8
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [(torch.randn(experts + 1, c, device=device, generator=gen),
               (torch.randn(experts + 1, 2 * width, c, device=device, generator=gen) * c ** -0.5).bfloat16(),
               (torch.randn(experts + 1, c, width, device=device, generator=gen) * width ** -0.5).bfloat16())
              for _ in range(3)]
    x0 = torch.randn(rows, c, device=device, generator=gen).bfloat16()
    ready = torch.zeros(experts + 1, dtype=torch.int32, device=device)

    def chain():
        x, outs = x0, []
        for w_router, gate_up, down in layers:
            ids, weights = route_triton(x, w_router, top_k, shared_gate=True)
            y = moe_experts_triton(x, ids, weights, gate_up, down, blocks=default_blocks(rows), ready=ready,
                                   out_dtype=torch.bfloat16)
            x = (x.float() + y.float()).bfloat16()
            outs += [ids, y]
        return outs

    def counters_zero(setting, replay):
        assert int(ready.count_nonzero()) == 0, f"PDL={setting}: replay {replay} left a ready counter set"

    _replays_equal_eager_with_and_without_pdl(monkeypatch, device, chain, counters_zero)
