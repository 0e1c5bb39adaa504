"""Startup refusals: the fast engine refuses an unfit checkpoint, draft or flag combination with the
reference's exact error (the shared loaders and validators), before any request; engine settings
it alone has are refused naming the field, the value and what was expected."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.llm import LLM
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.formats.errors import ConfigError, UserInputError
from dflash2.reference.tiny.target import write_tiny_target
from dflash2.reference.runner import ReferenceRunner


def refusal(make) -> tuple[type, str]:
    with pytest.raises(UserInputError) as exc:
        make()
    return type(exc.value), str(exc.value)


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("no-mtp") / "target", "tiny-dense-text")


def cases(tiny, no_mtp, tmp_path):
    t = tiny("tiny-dense")
    not_json = tmp_path / "not-json"
    shutil.copytree(t.target, not_json)
    (not_json / "config.json").write_text("{")
    dflash1 = tmp_path / "dflash1"
    shutil.copytree(t.draft, dflash1)
    config = json.loads((dflash1 / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]
    (dflash1 / "config.json").write_text(json.dumps(config))
    foreign = write_tiny_draft(tmp_path / "foreign", no_mtp)  # fitted to a 4-layer target, not this 6-layer one
    return {
        "missing folder": (tmp_path / "nowhere", {}),
        "config.json not JSON": (not_json, {}),
        "dflash without a draft": (t.target, dict(speculative_algorithm="dflash")),
        "draft path without dflash": (t.target, dict(speculative_algorithm="mtp", draft=t.draft)),
        "k without speculation": (t.target, dict(k=3)),
        "mtp without an MTP head": (no_mtp, dict(speculative_algorithm="mtp")),
        "mtp k = 0": (t.target, dict(speculative_algorithm="mtp", k=0)),
        "dflash k = 8 > block_size - 1": (t.target, dict(speculative_algorithm="dflash", draft=t.draft, k=8)),
        "a DFlash 1 draft": (t.target, dict(speculative_algorithm="dflash", draft=dflash1)),
        "a draft of another target": (t.target, dict(speculative_algorithm="dflash", draft=foreign)),
        "unknown algorithm": (t.target, dict(speculative_algorithm="eagle")),
    }


def test_refusals_equal_the_reference(tiny, no_mtp, tmp_path):
    for name, (path, kw) in cases(tiny, no_mtp, tmp_path).items():
        algorithm, draft, steps = kw.get("speculative_algorithm", "none"), kw.get("draft"), kw.get("k")
        expected = refusal(lambda: ReferenceRunner(path, speculative_algorithm=algorithm, draft_model_path=draft,
                                                   k=steps))
        got = refusal(lambda: LLM(path, speculative_algorithm=algorithm, speculative_draft_model_path=draft,
                                  speculative_num_steps=steps))
        assert got == expected, name


@pytest.mark.parametrize("field, value, needle", [
    ("max_running_req", 0, "max_running_req=0: expected an integer >= 1"),
    ("max_num_batched_tokens", 2.5, "max_num_batched_tokens=2.5"),
    ("page_size", True, "page_size=True"),
    ("memory_ratio", 1.5, "memory_ratio=1.5: expected a number in (0, 1]"),
    ("dtype", "int8", "dtype='int8'"),
    ("device", "tpu", "device='tpu'"),
    ("max_model_len", 1, "max_model_len=1"),
    ("cpu_cache_bytes", 0, "cpu_cache_bytes=0"),
    ("seed", -1, "seed=-1"),
])
def test_engine_settings_are_validated(tiny, field, value, needle):
    with pytest.raises(ConfigError) as exc:
        EngineConfig(model_path=str(tiny("tiny-dense").target), **{field: value})
    assert needle in str(exc.value)


def test_settings_that_need_the_model(tiny):
    t = tiny("tiny-dense")
    with pytest.raises(ConfigError, match=r"max_model_len=40000: expected at most the model's context of 32768"):
        LLM(t.target, max_model_len=40000)
    with pytest.raises(ConfigError, match=r"cpu_cache_bytes: the cache budget of .* no KV page"):
        LLM(t.target, device="cpu", speculative_algorithm="dflash", speculative_draft_model_path=t.draft,
            cpu_cache_bytes=1 << 20)
