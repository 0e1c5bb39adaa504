"""Every user error ``ft generate`` can meet: exit status 2, one line on stderr naming the field and
the value, no traceback, nothing on stdout, and no forward pass of the model (issue #2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import TinyTargetSpec, tiny_target_config, write_tiny_target

PROMPT = ["--prompt-ids", "5,17,42,99,3"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def edit_json(file, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def edit_tensors(file, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def text_config(data: dict) -> dict:
    return data.get("text_config", data)


def assert_refused(run, forward_calls, *needles: str) -> str:
    """Exit 2, one stderr line that names every needle, no traceback, nothing generated."""
    assert run.code == 2, (run.out, run.err)
    assert run.out == ""
    lines = run.err.splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("ft generate: error: "), lines[0]
    assert "Traceback" not in run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert forward_calls == [], "the model ran although the request was refused"
    return lines[0]


# --- the checkpoint folder -----------------------------------------------------------------------


def test_model_path_does_not_exist(ft, forward_calls, tmp_path):
    missing = tmp_path / "no-such-model"
    run = ft("generate", "--model", missing, *PROMPT)
    assert_refused(run, forward_calls, "model path", str(missing), "does not exist")


def test_model_path_is_a_file(ft, forward_calls, made):
    config = made("tiny-dense").target / "config.json"
    assert_refused(ft("generate", "--model", config, *PROMPT), forward_calls, str(config), "not a directory")


def test_folder_without_config_json(ft, forward_calls, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_refused(ft("generate", "--model", tmp_path, *PROMPT), forward_calls, str(tmp_path), "no config.json")


def test_config_json_that_is_not_json(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    (path / "config.json").write_text("{ not json")
    assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "config.json", "not valid JSON")


def test_config_json_that_is_not_an_object(ft, damaged):
    path = damaged("tiny-dense")
    (path / "config.json").write_text("[]")
    run = ft("generate", "--model", path, *PROMPT)
    assert run.code == 2 and "config.json" in run.err


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe-text"])  # the wrapper's and the flat model_type
def test_another_model_type(ft, forward_calls, damaged, preset):
    path = damaged(preset)
    edit_json(path / "config.json", lambda d: d.update(model_type="llama"))
    assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "model_type='llama'")


def test_quantized_config(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    edit_json(path / "config.json", lambda d: d.update(quantization_config={"quant_method": "fp8"}))
    assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "quantization_config")


def test_missing_tensor(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    name = "model.language_model.layers.1.mlp.down_proj.weight"
    edit_tensors(path / "model.safetensors", lambda t: t.pop(name))
    assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "missing tensor", repr(name))


def test_missing_tensor_in_a_shard(ft, forward_calls, damaged):
    """tiny-dense-text is sharded with an index: the tensor goes from both the shard and the index."""
    path = damaged("tiny-dense-text")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.2.linear_attn.out_proj.weight"
    shard = index["weight_map"].pop(name)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    edit_tensors(path / shard, lambda t: t.pop(name))
    assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "missing tensor", repr(name))


def test_tensor_of_the_wrong_shape(ft, forward_calls, damaged):
    path = damaged("tiny-moe")
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].clone()

    edit_tensors(path / "model.safetensors", shrink)
    line = assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, repr(name), "has shape")
    assert "expected" in line


def test_tokenizer_with_more_ids_than_the_model(ft, forward_calls, made, tmp_path):
    """A model of 400 ids (tensors to match) shipped with the 500-id small tokenizer."""
    spec = TinyTargetSpec(vocab_size=400, num_layers=2, full_attention_interval=2, eos_token_ids=(1,),
                          bos_token_id=1, pad_token_id=1)
    path = write_tiny_target(tmp_path / "small-vocab", spec, tokenizer=None)
    for name in TOKENIZER_FILES:
        shutil.copy(made("tiny-dense").target / name, path / name)
    line = assert_refused(ft("generate", "--model", path, *PROMPT), forward_calls, "vocab_size is 400")
    assert "tokenizer produces ids up to 499" in line


def test_prompt_ids_outside_the_vocabulary(ft, forward_calls, made):
    run = ft("generate", "--model", made("tiny-dense").target, "--prompt-ids", "5,512,7")
    assert_refused(run, forward_calls, "prompt token ids [512]", "[0, 512)")


def test_empty_prompt(ft, forward_calls, made):
    run = ft("generate", "--model", made("tiny-dense").target, "--prompt", "")
    assert_refused(run, forward_calls, "prompt", "empty")


def test_prompt_longer_than_a_small_context(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    edit_json(path / "config.json", lambda d: text_config(d).update(max_position_embeddings=8))
    run = ft("generate", "--model", path, *PROMPT, "--max-tokens", "4")
    assert_refused(run, forward_calls, "prompt (5 tokens) + max_tokens (4) = 9", "context of 8 tokens")


def test_max_tokens_past_the_context(ft, forward_calls, made):
    run = ft("generate", "--model", made("tiny-moe").target, *PROMPT, "--max-tokens", "40000")
    assert_refused(run, forward_calls, "max_tokens (40000)", "context of 32768 tokens")


# --- sampling parameters and flags ---------------------------------------------------------------


@pytest.mark.parametrize("flag, value, needle", [
    ("--temperature", "-0.5", "temperature=-0.5"),
    ("--temperature", "nan", "temperature=nan"),
    ("--top-p", "0", "top_p=0.0"),
    ("--top-p", "1.5", "top_p=1.5"),
    ("--top-k", "-2", "top_k=-2"),
    ("--top-k", "0", "top_k=0"),
    ("--max-tokens", "0", "max_tokens=0"),
    ("--max-tokens", "-3", "max_tokens=-3"),
    ("--seed", "-1", "seed=-1"),
    ("--seed", str(2**64), f"seed={2**64}"),
    ("--n", "0", "n=0"),
    ("--stop", "", "stop=''"),
])
def test_bad_sampling_value(ft, forward_calls, made, flag, value, needle):
    run = ft("generate", "--model", made("tiny-dense").target, *PROMPT, flag, value)
    assert_refused(run, forward_calls, needle, "expected")


def test_chat_with_prompt_ids(ft, forward_calls, made):
    run = ft("generate", "--model", made("tiny-dense").target, *PROMPT, "--chat")
    assert_refused(run, forward_calls, "--chat", "--prompt")


def test_prompt_text_without_tokenizer_files(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    for name in TOKENIZER_FILES:
        (path / name).unlink()
    run = ft("generate", "--model", path, "--prompt", "Hello")
    assert_refused(run, forward_calls, str(path), "no tokenizer files", "--prompt-ids")
    # the same folder still serves token ids
    assert ft("generate", "--model", path, *PROMPT, "--max-tokens", "2", "--temperature", "0").code == 0


def test_stop_string_without_tokenizer_files(ft, forward_calls, damaged):
    path = damaged("tiny-dense")
    for name in TOKENIZER_FILES:
        (path / name).unlink()
    assert_refused(ft("generate", "--model", path, *PROMPT, "--stop", "x"), forward_calls, "stop strings",
                   "tokenizer")


def test_trace_into_a_missing_folder(ft, forward_calls, made, tmp_path):
    trace = tmp_path / "no-such-dir" / "trace.jsonl"
    run = ft("generate", "--model", made("tiny-dense").target, *PROMPT, "--speculative-algorithm", "mtp",
             "--trace", trace)
    assert_refused(run, forward_calls, f"trace={str(trace)!r}")


# --- speculative decoding ------------------------------------------------------------------------


def spec(made, preset="tiny-dense", *extra) -> list:
    return ["generate", "--model", made(preset).target, *PROMPT, *extra]


def test_dflash_without_a_draft(ft, forward_calls, made):
    run = ft(*spec(made, "tiny-dense", "--speculative-algorithm", "dflash"))
    assert_refused(run, forward_calls, "speculative_draft_model_path=None", "draft")


def test_dflash_draft_path_that_does_not_exist(ft, forward_calls, made, tmp_path):
    missing = tmp_path / "no-draft"
    run = ft(*spec(made, "tiny-dense", "--speculative-algorithm", "dflash", "--speculative-draft-model-path", missing))
    assert_refused(run, forward_calls, "speculative_draft_model_path", str(missing))


@pytest.mark.parametrize("algorithm", ["none", "mtp"])
def test_draft_path_without_dflash(ft, forward_calls, made, algorithm):
    draft = made("tiny-dense").draft
    args = ["--speculative-draft-model-path", draft] + (["--speculative-algorithm", algorithm] if algorithm != "none"
                                                         else [])
    run = ft(*spec(made, "tiny-dense", *args))
    assert_refused(run, forward_calls, f"speculative_draft_model_path={str(draft)!r}", f"got {algorithm!r}")


def test_num_steps_without_speculation(ft, forward_calls, made):
    run = ft(*spec(made, "tiny-dense", "--speculative-num-steps", "3"))
    assert_refused(run, forward_calls, "speculative_num_steps=3", "'mtp' or 'dflash'")


def test_mtp_on_a_target_without_an_mtp_head(ft, forward_calls, made):
    run = ft(*spec(made, "tiny-dense-text", "--speculative-algorithm", "mtp"))
    assert_refused(run, forward_calls, "mtp_num_hidden_layers=0", "no MTP head")


@pytest.mark.parametrize("steps", ["0", "8", "99"])
def test_mtp_num_steps_outside_its_bound(ft, forward_calls, made, steps):
    run = ft(*spec(made, "tiny-moe", "--speculative-algorithm", "mtp", "--speculative-num-steps", steps))
    assert_refused(run, forward_calls, f"speculative_num_steps={steps}", "1 .. 7")


@pytest.mark.parametrize("steps", ["0", "8", "-1"])
def test_dflash_num_steps_outside_the_block(ft, forward_calls, made, steps):
    m = made("tiny-dense")
    run = ft(*spec(made, "tiny-dense", "--speculative-algorithm", "dflash", "--speculative-draft-model-path", m.draft,
                   "--speculative-num-steps", steps))
    assert_refused(run, forward_calls, f"speculative_num_steps={steps}", "1 .. block_size - 1 = 7")


@pytest.fixture
def draft_copy(made, tmp_path):
    copy = tmp_path / "draft"
    shutil.copytree(made("tiny-dense").draft, copy)
    return copy


def run_dflash(ft, made, draft):
    return ft(*spec(made, "tiny-dense", "--speculative-algorithm", "dflash", "--speculative-draft-model-path", draft))


def test_dflash1_draft(ft, forward_calls, made, draft_copy):
    edit_json(draft_copy / "config.json", lambda d: d.update(architectures=["DFlashDraftModel"]))
    assert_refused(run_dflash(ft, made, draft_copy), forward_calls, "architectures=['DFlashDraftModel']",
                   "DFlash 1")


def test_causal_draft(ft, forward_calls, made, draft_copy):
    edit_json(draft_copy / "config.json", lambda d: d.update(is_causal=True))
    assert_refused(run_dflash(ft, made, draft_copy), forward_calls, "is_causal=True")


def test_draft_written_for_a_target_of_another_hidden_size(ft, forward_calls, made, tmp_path):
    other = tiny_target_config(TinyTargetSpec(hidden_size=48, num_layers=6, full_attention_interval=3))
    draft = write_tiny_draft(tmp_path / "draft-48", other)
    assert_refused(run_dflash(ft, made, draft), forward_calls, "hidden_size=48", "hidden_size=40")


def test_draft_written_for_a_target_of_another_vocabulary(ft, forward_calls, made, tmp_path):
    other = tiny_target_config(TinyTargetSpec(vocab_size=600, num_layers=6, full_attention_interval=3))
    draft = write_tiny_draft(tmp_path / "draft-600", other)
    assert_refused(run_dflash(ft, made, draft), forward_calls, "vocab_size=600", "vocab_size=512")


def test_draft_missing_a_tensor(ft, forward_calls, made, draft_copy):
    name = "layers.1.mlp_conv.base_kernel"
    edit_tensors(draft_copy / "model.safetensors", lambda t: t.pop(name))
    assert_refused(run_dflash(ft, made, draft_copy), forward_calls, "missing tensor", repr(name))


def test_draft_tensor_of_the_wrong_shape(ft, forward_calls, made, draft_copy):
    name = "candidate_selector.successor_codebook"

    def widen(tensors):
        tensors[name] = torch.cat([tensors[name], tensors[name][:, :1]], dim=1)

    edit_tensors(draft_copy / "model.safetensors", widen)
    assert_refused(run_dflash(ft, made, draft_copy), forward_calls, repr(name))


# --- argparse's own refusals: status 2, usage and the flag, no traceback ------------------------


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--model", "m", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--prompt", "a"], "not allowed with"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--temperature", "hot"], "--temperature"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--engine", "warp-drive"], "--engine"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--speculative-algorithm", "eagle"], "--speculative-algorithm"),
])
def test_argparse_refusals(capsys, argv, needle):
    from dflash2.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("ft generate: error:") and needle in err.splitlines()[-1]
    assert "Traceback" not in err


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_a_cuda_device_this_machine_lacks_is_one_line(ft, made, device):
    """``--device cuda`` where torch sees fewer CUDA devices: one line naming the field, status 2, no traceback."""
    import torch

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device")
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = ft("generate", "--model", str(made("tiny-dense").target), "--prompt-ids", "1,2", "--device", device)
    assert run.code == 2 and run.out == "" and "Traceback" not in run.err
    lines = run.err.splitlines()
    assert len(lines) == 1 and f"device={device!r}" in lines[0], run.err
