"""llama.cpp as the numeric oracle on quantized GGUF files (issue 35). Run by scripts/gguf_oracle.sh.

Usage: python scripts/gguf_oracle.py <work dir> <out dir> <sources dir>

Needs the ``llama_cpp`` package of llama-cpp-python built from its sdist (the shell script puts it on
sys.path) and gguf-py; reads nothing of dflash2. Inputs: ``<work>/<preset>-f32.gguf`` as llama.cpp's
converter wrote them, and ``<sources>/<preset>`` (the safetensors checkpoints, fingerprinted only).

Per preset:
- quantize the F32 file with llama.cpp's quantizer (``llama_model_quantize``, ``pure``: every weight
  llama.cpp quantizes at all goes to the asked type, but for its own shape fallbacks) to each of
  its ``PRESETS`` types, into ``<out>/<preset>-<type>.gguf``. IQ3_XXS needs an importance matrix (llama.cpp
  refuses without one: "this quantization requires an imatrix"); a uniform one (all ones) is given;
- run llama.cpp on the F32 file and on each quantized one (CPU, fp32 KV cache, no flash attention,
  token ids in): per prompt, the logits of every prompt position and ``GEN`` greedy tokens with
  llama.cpp's top-2 logit margin at each step;
- per non-F32 weight of each quantized file, the sha256 of the float32 values ggml's own
  dequantization gives (``ggml_get_type_traits(type)->to_float``, the C code ggml's CPU get_rows
  uses), with their sum and the sum of their absolute values.

Writes ``<out>/oracle.npz`` (logits, tokens, margins) and ``<out>/oracle.json`` (provenance, per-file
weight types and dequantization digests).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import platform
import sys
from pathlib import Path

import importlib.util
import re
import types

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from dflash2.reference.tiny.fingerprint import fingerprint


def _low_level_bindings():
    """``llama_cpp.llama_cpp`` (the ctypes API) without the package's ``__init__``, whose high-level
    ``Llama`` class pulls in jinja2 and diskcache."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama_cpp (llama-cpp-python) is not on sys.path; see scripts/gguf_oracle.sh")
    package_dir = Path(list(spec.submodule_search_locations)[0])
    package = types.ModuleType("llama_cpp")
    package.__path__ = [str(package_dir)]
    version = re.search(r'__version__ = "([^"]+)"', (package_dir / "__init__.py").read_text())
    package.__version__ = version.group(1) if version else "unknown"
    sys.modules["llama_cpp"] = package
    from llama_cpp import llama_cpp as bindings

    bindings.__version__ = package.__version__
    bindings.lib_dir = package_dir / "lib"
    return bindings


llama_cpp = _low_level_bindings()

FTYPES = {  # file suffix -> llama_ftype (pure: the ftype's default weight type everywhere)
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "iq4_xs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
    "iq3_xxs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ3_XXS,
}
# Every type on the dense target; on the MoE one (3-D expert tensors) a K-quant and an IQ grid type,
# to keep the committed files small.
PRESETS = {"tiny-dense-256": tuple(FTYPES), "tiny-moe-256": ("q4_k", "iq3_xxs")}
NEEDS_IMATRIX = ("iq3_xxs",)
PROMPTS = ([5, 17, 42, 99, 3, 250, 7, 64, 128, 11], [300, 2, 77, 150, 9, 41, 12])
GEN = 16
THREADS = 2
N_CTX = 64
GGML_TYPE_F32 = 0


# --- quantizer -------------------------------------------------------------------------------------


def weight_shapes(path: Path) -> dict[str, list[int]]:
    """ggml ``ne`` (fastest first, trailing 1s dropped) of every tensor of two or more dimensions."""
    out = {}
    for t in GGUFReader(path).tensors:
        ne = [int(n) for n in t.shape]
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        if len(ne) >= 2:
            out[t.name] = ne
    return out


def quantize(src: Path, dst: Path, ftype: int, imatrix: bool) -> dict:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = True
    params.nthread = THREADS
    keep = []
    if imatrix:  # uniform importance: ne0 x n_expert ones per weight, as llama.cpp sizes an entry
        shapes = {n: ne for n, ne in weight_shapes(src).items() if n != "token_embd.weight"}
        entries = (llama_cpp.llama_model_imatrix_data * (len(shapes) + 1))()
        for entry, (name, ne) in zip(entries, shapes.items()):
            size = ne[0] * (ne[2] if len(ne) > 2 else 1)
            data = (ctypes.c_float * size)(*([1.0] * size))
            keep.append(data)
            entry.name, entry.data, entry.size = name.encode(), ctypes.cast(data, ctypes.POINTER(ctypes.c_float)), size
        entries[len(shapes)].name = None
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(entries)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}")
    return {"ftype": int(ftype), "pure": True, "nthread": THREADS, "imatrix": "uniform (all ones)" if imatrix else None}


# --- runner ----------------------------------------------------------------------------------------


class Runner:
    """One GGUF file in llama.cpp, CPU only: a fresh context per prompt."""

    def __init__(self, path: Path):
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def _context(self):
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = N_CTX
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = THREADS
        cparams.type_k = cparams.type_v = GGML_TYPE_F32
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise SystemExit("llama_init_from_model failed")
        return ctx

    def _decode(self, ctx, tokens: list[int], start: int) -> np.ndarray:
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(tokens)
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"llama_decode returned {rc}")
            return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                             .copy() for i in range(len(tokens))])
        finally:
            llama_cpp.llama_batch_free(batch)

    def greedy(self, prompt: list[int], n: int) -> tuple[np.ndarray, list[int], list[float]]:
        """Logits of every prompt position; n greedy tokens and the top-2 margin each was chosen by."""
        ctx = self._context()
        try:
            logits = self._decode(ctx, prompt, 0)
            last, tokens, margins = logits[-1], [], []
            for step in range(n):
                top = np.sort(last)[-2:]
                tokens.append(int(np.argmax(last)))
                margins.append(float(top[1] - top[0]))
                if step + 1 < n:
                    last = self._decode(ctx, [tokens[-1]], len(prompt) + step)[0]
            return logits.astype(np.float32), tokens, margins
        finally:
            llama_cpp.llama_free(ctx)

    def close(self):
        llama_cpp.llama_model_free(self.model)


# --- ggml's dequantization -------------------------------------------------------------------------


class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
                ("from_float_ref", ctypes.c_void_p)]


def _ggml_base():
    lib = ctypes.CDLL(str(llama_cpp.lib_dir / "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def ggml_dequantized(path: Path, ggml) -> dict[str, dict]:
    """Per non-F32 weight: sha256, sum and absolute sum of ggml's to_float over the whole tensor, in
    memory order (GGUF's fastest-first dimensions, i.e. torch order flattened)."""
    out = {}
    for t in GGUFReader(path).tensors:
        if t.tensor_type == GGMLQuantizationType.F32:
            continue
        raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8)).reshape(-1)
        values = np.empty(int(t.n_elements), dtype=np.float32)
        traits = ggml.ggml_get_type_traits(int(t.tensor_type)).contents
        traits.to_float(raw.ctypes.data, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), values.size)
        out[t.name] = {"type": t.tensor_type.name, "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
                       "sum": float(values.astype(np.float64).sum()),
                       "abs_sum": float(np.abs(values.astype(np.float64)).sum())}
    return out


# --- main ------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(work: Path, out: Path, sources: Path) -> None:
    llama_cpp.llama_backend_init()
    ggml = _ggml_base()
    arrays: dict[str, np.ndarray] = {}
    files: dict[str, dict] = {}
    for preset, suffixes in PRESETS.items():
        f32 = work / f"{preset}-f32.gguf"
        runs = {f"{preset}-f32": (f32, {"quantize": None, "committed": False})}
        for suffix in suffixes:
            dst = out / f"{preset}-{suffix}.gguf"
            runs[f"{preset}-{suffix}"] = (dst, {"quantize": quantize(f32, dst, FTYPES[suffix], suffix in NEEDS_IMATRIX),
                                               "committed": True})
        for stem, (path, info) in runs.items():
            runner = Runner(path)
            for p, prompt in enumerate(PROMPTS):
                logits, tokens, margins = runner.greedy(prompt, GEN)
                arrays[f"{stem}/p{p}/logits"] = logits
                arrays[f"{stem}/p{p}/tokens"] = np.asarray(tokens, dtype=np.int32)
                arrays[f"{stem}/p{p}/margins"] = np.asarray(margins, dtype=np.float32)
            runner.close()
            types: dict[str, list[str]] = {}
            for t in GGUFReader(path).tensors:
                types.setdefault(t.tensor_type.name, []).append(t.name)
            files[stem] = {**info, "source": preset, "weight_types": types,
                           "sha256": sha256(path) if info["committed"] else None,
                           "ggml_dequantized": ggml_dequantized(path, ggml) if info["committed"] else None}
            print(f"{stem}: " + ", ".join(f"{k} x{len(v)}" for k, v in types.items()), flush=True)
    np.savez_compressed(out / "oracle.npz", **arrays)
    fingerprints = {f"{f.parent.name}/{f.name}": fingerprint(f) for f in sorted(sources.glob("*/*"))
                    if f.suffix in (".safetensors", ".json")}
    meta = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "machine": platform.machine(),
        "prompts": [list(p) for p in PROMPTS],
        "gen": GEN,
        "context": {"n_ctx": N_CTX, "n_threads": THREADS, "type_k": "f32", "type_v": "f32", "flash_attn": False,
                    "device": "CPU"},
        "commands": {
            "regenerate": "scripts/gguf_oracle.sh",
            "convert": "scripts/gguf_convert.py <sdist>/vendor/llama.cpp <preset folder> --outfile <preset>-f32.gguf "
                       "--outtype f32 --no-mtp",
            "quantize": "llama_model_quantize(<preset>-f32.gguf, <preset>-<type>.gguf, pure=true, ftype=<type's>); "
                        "IQ3_XXS with a uniform importance matrix (all ones)",
            "run": "llama_decode on a fresh context per prompt: the prompt in one batch (logits of every position), "
                   "then one token at a time, greedy (first index of the maximum)",
        },
        "files": files,
        "sources": fingerprints,
    }
    (out / "oracle.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
