"""``ft bench`` end to end on a tiny dummy model (CPU): every setting runs, the report files are written,
the simulated acceptance gives exactly the asked tokens per step, and bad flags exit 2 naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2.bench.report import ratio_medians, step_ratios
from dflash2.bench.simulated import SimulatedAcceptance
from dflash2.cli.main import main
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_target(root / "target", "tiny-moe", tokenizer=None)
    draft = write_tiny_draft(root / "draft", target)
    return target, draft


def test_simulated_acceptance_tracks_the_mean():
    sim = SimulatedAcceptance(5.47)
    kept = [sim() for _ in range(100)]
    assert set(kept) <= {4, 5} and sum(kept) == 447  # 4.47 drafts kept per step, 5.47 tokens committed


@pytest.fixture
def acceptance_steps(monkeypatch) -> list[int]:
    """The step index of every simulated verify, in order (ft bench's SimulatedAcceptance, recorded)."""
    seen: list[int] = []

    class Recording(SimulatedAcceptance):
        def __call__(self) -> int:
            seen.append(self.step)
            return super().__call__()

    monkeypatch.setattr("dflash2.bench.run.SimulatedAcceptance", Recording)
    return seen


def test_the_timed_run_repeats_the_warm_ups_acceptance(tiny, tmp_path, acceptance_steps):
    """Every verify of the timed run keeps what the warm-up's verify at the same step kept (so it meets no
    shape the warm-up did not: a new one would compile or capture inside the timed steps)."""
    seen = acceptance_steps
    target, draft = tiny
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                 "--runs", "dflash7:1:9", "--max-tokens", "12", "--simulate-tokens-per-step", "2.5",
                 "--out", str(tmp_path / "out")]) == 0
    half = len(seen) // 2
    assert half >= 2 and seen == list(range(half)) * 2, seen


def test_ft_bench_runs_every_setting_and_writes_its_report(tiny, tmp_path):
    target, draft = tiny
    out = tmp_path / "results"
    code = main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                 "--concurrency", "2", "--prompt-lens", "9", "--max-tokens", "10",
                 "--simulate-tokens-per-step", "3", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    runs = {r["setting"]: r for r in result["runs"]}
    assert set(runs) == {"off", "mtp3", "mtp7", "dflash3", "dflash7"}
    assert runs["off"]["tokens_per_step"] == 1.0 and runs["off"]["simulated_tokens_per_step"] is None
    for name in ("mtp3", "mtp7", "dflash3", "dflash7"):
        r = runs[name]
        assert r["steps"] >= 3 and r["step"] == "verify"
        assert r["acceptance_by_position"][0] == pytest.approx(1.0)  # 2 drafts kept per step
        assert r["acceptance_by_position"][2] == 0.0
    assert runs["dflash7"]["draft_params"] > 0 and runs["dflash7"]["ring_bytes_per_slot"] > 0
    text = (out / "bench.md").read_text()
    assert "simulated acceptance (timing only)" in text and "| dflash7 | 2 | 9 | verify |" in text
    ratio = runs["dflash7"]["step_ms_median"] / runs["off"]["step_ms_median"]
    speedup = runs["dflash7"]["tokens_per_s"] / runs["off"]["tokens_per_s"]
    assert (f"- dflash7 c=2 p=9: {runs['dflash7']['step_ms_median']:.2f} / {runs['off']['step_ms_median']:.2f} ms "
            f"= {ratio:.3f}; tok/s {speedup:.2f}x") in text
    assert "- sampling: greedy" in text


def test_repeats_time_every_generate_alike(tiny, tmp_path, acceptance_steps):
    """Each repeat is a timed generate that meets what the first met (the same acceptance, an empty cache):
    the steps pool, the wall figure is the median of the repeats'."""
    seen = acceptance_steps
    target, draft = tiny
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                 "--runs", "dflash7:1:9", "--max-tokens", "12", "--simulate-tokens-per-step", "2.5",
                 "--repeats", "3", "--out", str(out)]) == 0
    quarter = len(seen) // 4  # the warm-up and three timed generates, each the same steps
    assert quarter >= 2 and seen == list(range(quarter)) * 4, seen
    row = json.loads((out / "bench.json").read_text())["runs"][0]
    assert row["repeats"] == 3 and len(row["wall_s_runs"]) == 3
    assert row["wall_s"] == sorted(row["wall_s_runs"])[1]
    assert row["steps"] == 3 * quarter and row["tokens_per_step"] == 11 * 3 / row["steps"]
    assert "wall tok/s" in (out / "bench.md").read_text()


@pytest.mark.parametrize("flags, field", [
    (["--settings", "dflash7"], "need --draft"),
    (["--settings", "off", "--simulate-tokens-per-step", "9"], "simulate_tokens_per_step"),
    (["--settings", "off", "--max-tokens", "1"], "max_tokens"),
    (["--settings", "off", "--temperature", "-1"], "temperature"),
    (["--settings", "off", "--top-p", "0"], "top_p"),
    (["--settings", "off", "--repeats", "0"], "repeats"),
])
def test_bad_bench_flags_exit_2(tiny, capsys, flags, field):
    target, _ = tiny
    assert main(["bench", "--model", str(target), "--load-format", "dummy", *flags]) == 2
    assert field in capsys.readouterr().err


def test_explicit_runs_replace_the_cross_product(tiny, tmp_path):
    target, draft = tiny
    out = tmp_path / "runs"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                 "--runs", "off:1:9,dflash7:2:5", "--max-tokens", "6", "--out", str(out)]) == 0
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert [(r["setting"], r["concurrency"], r["prompt_len"]) for r in runs] == [("off", 1, 9), ("dflash7", 2, 5)]
    assert "One speculative step over one decode step" not in (out / "bench.md").read_text()  # no off run at c=2 p=5
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error
        main(["bench", "--model", str(target), "--runs", "dflash9:1:4"])
    assert exc.value.code == 2


def test_repeated_pairs_report_their_median_ratio():
    """Five off/dflash7 pairs at one concurrency and prompt (the issue's median of five) give one median line;
    a setting run once gives none; an even count takes the mean of the middle two."""
    def run(setting, ms, prompt=4096):
        return {"setting": setting, "algorithm": "none" if setting == "off" else "dflash", "concurrency": 1,
                "prompt_len": prompt, "step_ms_median": ms}
    runs = []
    for decode, verify in [(3.4, 7.2), (3.5, 7.1), (3.6, 7.2), (3.3, 7.0), (3.45, 7.25)]:
        runs += [run("off", decode), run("dflash7", verify)]
    runs += [run("off", 3.0, 512), run("dflash3", 4.5, 512)]
    pairs = step_ratios(runs)
    assert len(pairs) == 6
    (key, ratios, median), = ratio_medians(pairs)
    assert key == ("dflash7", 1, 4096) and len(ratios) == 5
    assert median == pytest.approx(sorted([7.2 / 3.4, 7.1 / 3.5, 7.2 / 3.6, 7.0 / 3.3, 7.25 / 3.45])[2])
    (_, _, even), = ratio_medians(pairs[:4])
    assert even == pytest.approx((sorted(r for _, _, r in pairs[:4])[1] + sorted(r for _, _, r in pairs[:4])[2]) / 2)


def test_the_speed_switches_reach_the_engine(tiny, tmp_path, monkeypatch):
    """``--no-side-stream`` and its kin turn off the EngineConfig fields of the same names; by default all are on."""
    import dflash2.bench.run as bench_run

    seen: list[dict] = []
    real_llm = bench_run.LLM

    def recording_llm(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("side_stream", "propose_ahead", "pdl", "l2_prefetch")})
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(bench_run, "LLM", recording_llm)
    target, draft = tiny
    common = ["bench", "--model", str(target), "--load-format", "dummy", "--runs", "off:1:9", "--max-tokens", "4"]
    assert main([*common, "--out", str(tmp_path / "on")]) == 0
    assert main([*common, "--no-side-stream", "--no-propose-ahead", "--no-pdl", "--no-l2-prefetch",
                 "--out", str(tmp_path / "off")]) == 0
    assert seen[0] == dict.fromkeys(seen[0], True) and seen[-1] == dict.fromkeys(seen[-1], False)


def test_an_adaptive_depth_run_reports_the_depths_it_chose(tiny, tmp_path):
    target, draft = tiny
    out = tmp_path / "adaptive"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy", "--runs",
                 "dflash7:2:9", "--max-tokens", "12", "--speculative-depth", "adaptive", "--out", str(out)]) == 0
    run = json.loads((out / "bench.json").read_text())["runs"][0]
    assert set(run["depths_chosen"]) == {"0", "1", "3", "7"} and sum(run["depths_chosen"].values()) == run["steps"]


def test_text_prompts_replace_random_ids_and_a_bad_file_is_refused(tmp_path, capsys):
    target = write_tiny_target(tmp_path / "target", "tiny-dense")  # with a tokenizer
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def f(x):\n", "class A:\n    pass\n"]}))
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--load-format", "dummy", "--runs", "off:3:64", "--max-tokens", "4",
                 "--prompts", str(prompts), "--out", str(out)]) == 0
    run = json.loads((out / "bench.json").read_text())["runs"][0]
    assert run["steps"] > 0 and 2 <= run["prompt_tokens_mean"] < 64  # the texts, cycled: not 64 random ids
    for bad in ("{}", '{"prompts": []}', '{"prompts": ["", "x"]}', "not json"):
        prompts.write_text(bad)
        assert main(["bench", "--model", str(target), "--runs", "off:1:8", "--prompts", str(prompts)]) == 2
        assert "prompts=" in capsys.readouterr().err


def test_a_sampled_run_draws_each_requests_own_seed(tiny, tmp_path):
    """--temperature / --top-p: every request samples (request i seeded i); the rows and the report say so."""
    target, draft = tiny
    out = tmp_path / "sampled"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy", "--runs",
                 "off:2:9,dflash7:2:9", "--max-tokens", "8", "--temperature", "1", "--top-p", "0.95",
                 "--out", str(out)]) == 0
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert all((r["temperature"], r["top_p"]) == (1.0, 0.95) and r["steps"] > 0 for r in runs)
    assert "- sampling: temperature 1.0, top-p 0.95, seed i for request i" in (out / "bench.md").read_text()


def test_the_step_clock_counts_the_steps_collected_under_overlap_scheduling():
    """Under overlap scheduling a verify returns one step's results and each collect the next one's: the clock
    counts each as a verify step (and calls the simulated acceptance's hook before each)."""
    from types import SimpleNamespace

    from dflash2.bench.run import StepClock

    class Runner:
        device = torch.device("cpu")

        def prefill(self, plan):
            return []

        def decode(self, plan):
            return []

        def verify(self, plan, **kw):
            return [SimpleNamespace(num_accepted=2), SimpleNamespace(num_accepted=0)]

        def collect(self, launch_next=None):
            return [SimpleNamespace(num_accepted=1), SimpleNamespace(num_accepted=3)]

    hooks = []
    runner = Runner()
    clock = StepClock(runner, before_verify=lambda: hooks.append(1))
    runner.verify(None, launch_next=None)
    for _ in range(3):
        runner.collect(None)
    assert len(clock.times["verify"]) == 4 and len(hooks) == 4
    assert clock.accepted == [2, 0] + [1, 3] * 3


def test_memory_ratio_and_prefix_caching_reach_the_engine(tiny, tmp_path, monkeypatch):
    """``--gpu-memory-utilization`` (vLLM's name) or ``--memory-ratio``, and ``--no-prefix-caching``, set the
    EngineConfig fields; by default the engine's memory ratio and prefix caching on."""
    import dflash2.bench.run as bench_run

    seen: list[dict] = []
    real_llm = bench_run.LLM

    def recording_llm(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("memory_ratio", "prefix_caching")})
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(bench_run, "LLM", recording_llm)
    target, _ = tiny
    common = ["bench", "--model", str(target), "--load-format", "dummy", "--runs", "off:1:9", "--max-tokens", "4"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--gpu-memory-utilization", "0.9", "--no-prefix-caching", "--out", str(tmp_path / "b")]) == 0
    assert main([*common, "--memory-ratio", "0.8", "--out", str(tmp_path / "c")]) == 0
    assert seen == [{"memory_ratio": None, "prefix_caching": True}, {"memory_ratio": 0.9, "prefix_caching": False},
                    {"memory_ratio": 0.8, "prefix_caching": True}]


def test_seed_acceptance_simulates_each_setting_at_its_own_figure(tiny, tmp_path):
    """``--simulate-tokens-per-step seed``: MTP and DFlash each at the seed's tokens per step for the target's family
    (the tiny MoE: 3.25 for MTP k=3, 5.39 for DFlash k=7), plain decoding at none; a bad value exits 2."""
    target, draft = tiny
    out = tmp_path / "seed"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                 "--runs", "off:1:9,mtp3:1:9,dflash7:1:9", "--max-tokens", "120", "--simulate-tokens-per-step", "seed",
                 "--out", str(out)]) == 0
    runs = {r["setting"]: r for r in json.loads((out / "bench.json").read_text())["runs"]}
    assert [runs[s]["simulated_tokens_per_step"] for s in ("off", "mtp3", "dflash7")] == [None, 3.25, 5.39]
    assert runs["mtp3"]["tokens_per_step"] == pytest.approx(3.25, abs=0.3)
    assert runs["dflash7"]["tokens_per_step"] == pytest.approx(5.39, abs=0.5)
    assert "seed's own committed tokens per step" in (out / "bench.md").read_text()
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(target), "--simulate-tokens-per-step", "lots", "--out", str(tmp_path / "x")])


def test_prefill_rows_count_what_the_timed_generate_prefilled(tiny, tmp_path):
    """Each row's prefill figures: the rows its prefill calls ran per timed generate (every prompt token: the cache
    was emptied), in chunks of max_num_batched_tokens rows, their tokens/s over prefill_s, the target's FLOPs of
    whole prompts (chunks sum to the prompt), and on CPU no matmul rate, hence no floor."""
    from dflash2.bench.floors import prefill_flops
    from dflash2.bench.report import markdown
    from dflash2.bench.run import BenchArgs, run
    from dflash2.reference.formats.config import load_target_config

    target, draft = tiny
    args = BenchArgs(model=str(target), draft=str(draft), load_format="dummy",
                     runs=[("off", 2, 40), ("dflash7", 1, 40)], max_tokens=4, simulate_tokens_per_step=None,
                     out_dir=tmp_path, repeats=2, extra={"max_num_batched_tokens": 32, "speculative_depth": "fixed"})
    result = run(args)
    assert result["bf16_matmul_TFLOPs"] is None
    cfg = load_target_config(target)
    for r, concurrency in zip(result["runs"], (2, 1)):
        assert "error" not in r, r
        assert r["prefill_tokens"] == concurrency * 40 and r["max_num_batched_tokens"] == 32
        assert r["prefill_calls"] >= -(-concurrency * 40 // 32)  # at most 32 rows a call
        assert r["prefill_tokens_per_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"])
        assert r["prefill_flops"] == pytest.approx(concurrency * prefill_flops(cfg, 40))
        assert r["prefill_floor_s"] is None and r["prefill_floor_fraction"] is None
    text = markdown(result)
    assert "| prefill s | prefill tok/s | prefill floor |" in text and "bf16 matmul rate measured in this run: -" in text
    off = result["runs"][0]
    assert f"| {off['prefill_s']:.2f} | {off['prefill_tokens_per_s']:.0f} | - |" in text


def test_prefill_tokens_follow_the_prompts_cut_lengths(tmp_path):
    """--prompts: the prefill counts each text's own token count (capped at prompt_len), not prompt_len."""
    target = write_tiny_target(tmp_path / "target", "tiny-dense")  # with a tokenizer
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def f(x):\n    return x\n", "class A:\n    pass\n" * 20]}))
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--load-format", "dummy", "--runs", "off:2:24", "--max-tokens", "4",
                 "--prompts", str(prompts), "--out", str(out)]) == 0
    run = json.loads((out / "bench.json").read_text())["runs"][0]
    assert 2 < run["prompt_tokens_mean"] < 24  # the first text is shorter than 24 tokens, the second is cut to 24
    assert run["prefill_tokens"] == 2 * run["prompt_tokens_mean"]


def test_matmul_rate_refuses_a_device_without_cuda_events():
    from dflash2.bench.measure import matmul_rate

    with pytest.raises(ValueError, match="device=cpu"):
        matmul_rate("cpu")


def test_the_seeds_kv_tokens_are_set_beside_the_real_shapes_on_an_80gb_card(tiny):
    from dflash2.bench.seed_figures import seed_kv_tokens
    from dflash2.reference.formats.config import load_target_config

    h100 = 81559 * 2**20
    moe, dense = (load_target_config(f"bench/shapes/{s}") for s in ("qwen3.5-35b-a3b", "qwen3.5-27b"))
    assert seed_kv_tokens(moe, "off", h100) == 224198 and seed_kv_tokens(moe, "dflash7", h100) == 142110
    assert seed_kv_tokens(dense, "off", h100) == 253435
    assert seed_kv_tokens(moe, "off", 143771 * 2**20) is None  # an H200: not the seed's card
    assert seed_kv_tokens(moe, "off", None) is None  # the CPU
    assert seed_kv_tokens(load_target_config(tiny[0]), "off", h100) is None


def test_a_run_reports_the_kv_tokens_its_budget_holds(tiny, tmp_path):
    target, _ = tiny
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--load-format", "dummy", "--runs", "off:1:8", "--max-tokens", "4",
                 "--out", str(out)]) == 0
    row = json.loads((out / "bench.json").read_text())["runs"][0]
    assert row["kv_tokens_budget"] >= row["kv_tokens"] > 0 and row["seed_kv_tokens"] is None
    assert f"- off c=1: {row['kv_tokens_budget']:,} KV tokens; activations 0 MiB" in (out / "bench.md").read_text()
