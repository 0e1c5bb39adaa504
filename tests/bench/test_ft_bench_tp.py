"""``ft bench --tp 2`` end to end on the CPU (gloo): a tiny dense target decoded plainly over two ranks, the
all-reduce bandwidth measured before the engine, every row at tp=2 with its floor split into one rank's bytes and
the collectives, the report showing both, the ranks gone afterwards; a bad ``--tp`` exits 2 naming the field."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from dflash2.bench.floors import tp_collective_bytes
from dflash2.cli.main import main
from dflash2.reference.formats.config import load_target_config
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("tp") / "target", "tiny-dense", tokenizer=None)


def test_ft_bench_tp2_reports_each_ranks_floor_and_the_measured_allreduce(dense, tmp_path, monkeypatch):
    import dflash2.bench.run as bench_run

    seen: list[int] = []
    real_llm = bench_run.LLM

    def recording_llm(*args, **kwargs):
        seen.append(kwargs["tensor_parallel_size"])
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(bench_run, "LLM", recording_llm)
    out = tmp_path / "out"
    assert main(["bench", "--model", str(dense), "--load-format", "dummy", "--runs", "off:2:9", "--max-tokens", "4",
                 "--tp", "2", "--out", str(out)]) == 0
    assert seen == [2] and not dist.is_initialized()  # the engine was closed: its rank stopped, its group gone
    result = json.loads((out / "bench.json").read_text())
    assert result["tp"] == 2
    measured = {m["bytes"]: m for m in result["allreduce"]["sizes"]}
    assert result["allreduce"]["backend"] == "gloo" and all(m["busbw_GBps"] > 0 for m in measured.values())
    (row,) = result["runs"]
    assert "error" not in row, row
    assert row["tp"] == 2 and row["steps"] > 0
    cfg = load_target_config(dense)
    comm = tp_collective_bytes(cfg, 4, rows=2, logit_rows=2, tp=2)  # fp32 on the CPU, 2 sequences of one row
    assert {comm.all_reduce_message, comm.all_gather_message, 16 << 20} == set(measured)
    assert row["allreduce_bus_bytes"] == comm.all_reduce and row["allgather_bus_bytes"] == comm.all_gather
    expected_ms = 1e3 * (comm.all_reduce / (1e9 * measured[comm.all_reduce_message]["busbw_GBps"])
                         + comm.all_gather / (1e9 * measured[comm.all_gather_message]["busbw_GBps"]))
    assert row["floor_allreduce_ms"] == pytest.approx(expected_ms, rel=1e-9) and row["floor_allreduce_ms"] > 0
    text = (out / "bench.md").read_text()
    assert "- all-reduce over tp=2 ranks measured in this run (gloo, float32" in text
    assert "| tp | step ms | floor ms | bytes floor | all-reduce floor |" in text
    assert f"| off | 2 | 9 | decode | 2 | {row['step_ms_median']:.2f} |" in text
    assert f"| {row['floor_allreduce_ms']:.2f} |" in text


def test_a_tp1_run_measures_nothing_and_has_no_collective_term(dense, tmp_path):
    out = tmp_path / "one"
    assert main(["bench", "--model", str(dense), "--load-format", "dummy", "--runs", "off:1:9", "--max-tokens", "4",
                 "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    (row,) = result["runs"]
    assert result["tp"] == 1 and result["allreduce"] is None
    assert row["tp"] == 1 and row["floor_allreduce_ms"] == 0 and row["allreduce_busbw_GBps"] is None
    assert "all-reduce over" not in (out / "bench.md").read_text()


def test_a_bad_tp_exits_2_naming_the_field(dense, capsys):
    assert main(["bench", "--model", str(dense), "--load-format", "dummy", "--runs", "off:1:9",
                 "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size=0" in capsys.readouterr().err
