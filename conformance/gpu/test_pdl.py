"""Programmatic dependent launch (fast/kernels/pdl.py) for the draft's own Triton kernels.

1. Off where it cannot run: on the CPU, under Triton's interpreter, and with ``DFLASH2_PDL=0``; then the
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

from dflash2.fast.kernels import pdl
from dflash2.fast.kernels.conv_finish_norm import conv_finish_norm_triton
from dflash2.fast.kernels.skinny_linear import SkinnyConfig, skinny_linear_triton
from dflash2.fast.kernels.tickets import MAX_COUNTERS, ticket_counters

KERNEL_DIR = Path(__file__).resolve().parents[2] / "fast" / "kernels"


@pytest.fixture
def fresh_cache():
    """pdl's per-device cache emptied around a test that changes the environment it read."""
    pdl._supported.cache_clear()
    yield
    pdl._supported.cache_clear()


def test_off_on_the_cpu():
    assert not pdl.pdl_enabled("cpu")
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options("cpu") == {}


def test_off_with_the_env_var(monkeypatch):
    monkeypatch.setenv("DFLASH2_PDL", "0")  # read before the device is looked at: no CUDA needed
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def test_off_under_the_interpreter(monkeypatch, fresh_cache):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("DFLASH2_PDL", raising=False)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def _is_gdc_call(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and ast.unparse(stmt.value.func) == f"tl.extra.cuda.{name}")


def pdl_kernels(directory: Path = KERNEL_DIR) -> dict[str, bool]:
    """``module:kernel`` -> whether it follows the rule, for every jit function with a ``PDL`` parameter."""
    found = {}
    for path in sorted(directory.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or "PDL" not in [a.arg for a in node.args.args]:
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            first = body[0] if body else None
            found[f"{path.stem}:{node.name}"] = (
                isinstance(first, ast.If) and ast.unparse(first.test) == "PDL" and not first.orelse
                and len(first.body) == 2 and _is_gdc_call(first.body[0], "gdc_wait")
                and _is_gdc_call(first.body[1], "gdc_launch_dependents"))
    return found


def test_every_pdl_kernel_waits_first():
    kernels = pdl_kernels()
    assert set(kernels) == {
        "skinny_linear:_skinny_linear_kernel", "ring_attention:_ring_split_kernel",
        "ring_attention:_ring_merge_kernel", "dynamic_conv:_grouped_dynamic_conv_kernel",
        "conv_finish_norm:_conv_finish_norm_kernel", "attention_prologue:_draft_qk_norm_rope_kernel",
        "selector:_block_topk_kernel", "selector:_merge_topk_kernel", "selector:_walk_kernel"}
    assert [name for name, ok in kernels.items() if not ok] == []


def test_the_rule_check_catches_a_load_before_the_wait(tmp_path):
    (tmp_path / "rogue.py").write_text(
        "@triton.jit\ndef k(x_ptr, PDL: tl.constexpr):\n    x = tl.load(x_ptr)\n"
        "    if PDL:\n        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n")
    assert pdl_kernels(tmp_path) == {"rogue:k": False}


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
    replays = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("DFLASH2_PDL", setting)
        assert pdl.pdl_enabled(device) == (setting == "1")
        eager = [t.clone() for t in chain()]  # compiles this setting's variants outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        for replay in range(4):
            for t in captured:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, eager)), f"PDL={setting}: replay {replay} != eager"
            assert int(counters.count_nonzero()) == 0, f"PDL={setting}: replay {replay} left a ticket counter set"
        replays[setting] = [t.clone() for t in captured]
    assert all(torch.equal(a, b) for a, b in zip(replays["1"], replays["0"])), "PDL changed the bits"
