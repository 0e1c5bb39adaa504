"""The engine's startup configuration: one frozen dataclass, validated once, read by every module.

``ft generate`` builds its flags from these fields (``add_engine_args``), so a default lives in one
place. Two fields resolve at startup from the machine: ``device`` ``"auto"`` is ``cuda`` when a GPU
is visible, else ``cpu``; ``dtype`` ``"auto"`` is bfloat16 on CUDA and float32 on CPU (CPU bf16
matmuls are slow and the CPU lane is where the engine is held token for token to the fp32
reference). Every refusal is a :class:`ConfigError` naming the field, its value and what was
expected, as the reference's config validation does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

import torch

from dflash2.reference.formats.errors import ConfigError, expect, is_int

from ..kernels.quant.layout import QUANT_TYPES

SPECULATIVE_ALGORITHMS = ("none", "mtp", "dflash")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from config.json alone (reference/tiny/dummy.py)
DUMMY_WEIGHT_TYPES = tuple(t.name for t in QUANT_TYPES)  # --dummy-weight-type: the GGUF types the kernels decode
SPECULATIVE_DEPTHS = ("fixed", "adaptive")  # fast/speculative/depth.py
# each off gives the same tokens (A/B timing)
SPEED_SWITCHES = ("side_stream", "propose_ahead", "overlap_schedule", "pdl", "l2_prefetch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
AUTO = "auto"
MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = AUTO  # float32 | bfloat16 | float16 | auto (bf16 on CUDA, fp32 on CPU)
    device: str = AUTO  # cpu | cuda | cuda:N | auto
    max_running_req: int = 4  # requests decoding at once (one GDN state slot each)
    max_num_batched_tokens: int = 2048  # prefill rows per step (a longer prompt is chunked)
    page_size: int = 16  # tokens per KV page
    # CUDA: the fraction of device memory the weights, caches and measured activations may use together (the
    # rest: fragmentation and what the profiling forward cannot see); aimed at the Qwen3.5-MoE 35B-A3B shape sizing
    # >= 200k KV tokens on an 80 GB card beside its 65.6 GiB of bf16 weights (fast/engine/memory.py)
    memory_ratio: float = 0.92
    cpu_cache_bytes: int = 256 * MiB  # CPU: the byte budget of the KV pages, state slots and draft rings
    max_model_len: int | None = None  # tokens per request (prompt + output); None: the model's context
    speculative_algorithm: str = "none"  # none | mtp | dflash
    speculative_draft_model_path: str | None = None  # the DFlash 2 draft folder or .gguf file (dflash only)
    speculative_num_steps: int | None = None  # k drafts per verify; None: block_size - 1 (dflash), 3 (mtp)
    # adaptive: each step the depth in 0..k that commits the most tokens per second, from measured step times and
    # acceptance (fast/speculative/depth.py; a seed's sampled tokens then depend on load); fixed: every step drafts k
    speculative_depth: str = "adaptive"
    seed: int = 0  # seeds torch's global generator at startup; every sampling draw is keyed by the request's seed
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights (timing only)
    # with load_format dummy: the target's matrices as random GGUF blocks of this type (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS,
    # IQ3_XXS), kept quantized as a GGUF file's are (fast/weights/dummy_quantized.py); None: dense in the model dtype
    dummy_weight_type: str | None = None
    enforce_eager: bool = False  # CUDA: run every step eagerly instead of replaying captured CUDA graphs
    # CUDA: prefill steps of at most this many rows (capped at max_num_batched_tokens), each chunk at most
    # delta_rule.SHORT_PREFILL_ROWS, replay captured graphs (engine/graphs/prefill_graphs.py: a short chunk is bound by the
    # host's launches); 0: every prefill step eager. 0 until ft serve's warm-up with them (capture_all) has run on a
    # GPU: the H100 has run them through LLM and prefill_trace (bench/results/2026-12-08-h100-prefill-graphs/)
    prefill_graph_rows: int = 0
    # the speed switches below are all on by default; each off gives the same tokens (A/B timing, debugging)
    side_stream: bool = True  # CUDA: a verify step's DFlash observe on a second stream beside the step
    propose_ahead: bool = True  # CUDA: a steady DFlash step launches the next step's proposal before it returns
    # CUDA: a steady speculative step launches the whole next step before its tokens are read, so the host commits step
    # n while the GPU runs step n + 1 (engine/runner.py); --disable-overlap-schedule (SGLang's name) turns it off
    overlap_schedule: bool = True
    pdl: bool = True  # Hopper+: the draft's and the MoE's kernels launch with programmatic dependent launch
    l2_prefetch: bool = True  # Hopper+: tuned GEMMs prefetch their weight slice into L2 before their PDL wait
    # prefix caching (engine/prefix_cache.py): prompts resume from snapshots of earlier requests' state, taken every
    # snapshot_interval prompt tokens (a multiple of page_size; a prefill chunk ends there) and at each finish;
    # None: max_num_batched_tokens rounded down to a page, so a lone prompt's chunks are not split further (each chunk
    # reads every weight once: more chunks cost weight traffic, the MoE's most); --no-prefix-caching turns it off
    prefix_caching: bool = True
    snapshot_interval: int | None = None
    prefix_snapshots: int | None = None  # snapshot slots (GDN state + the proposer's); None: up to 4 per request slot
    # the target sharded over this many processes (engine/tp/workers.py: this one is rank 0, the others
    # spawned; gloo on the CPU, NCCL on CUDA with rank r on cuda:r; the proposer on rank 0); > 1: every step eager
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            expect(self.dtype in names, ConfigError, "dtype", self.dtype, f"one of {sorted(DTYPES)}")
            object.__setattr__(self, "dtype", names[self.dtype])
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.speculative_algorithm is None:
            object.__setattr__(self, "speculative_algorithm", "none")
        if not isinstance(self.model_path, str) and self.model_path is not None:
            object.__setattr__(self, "model_path", str(self.model_path))
        if self.speculative_draft_model_path is not None and not isinstance(self.speculative_draft_model_path, str):
            object.__setattr__(self, "speculative_draft_model_path", str(self.speculative_draft_model_path))
        self.validate()

    def validate(self) -> None:
        expect(isinstance(self.model_path, str) and self.model_path != "", ConfigError, "model_path",
               self.model_path, "a checkpoint folder")
        expect(self.dtype == AUTO or self.dtype in DTYPES, ConfigError, "dtype", self.dtype,
               f"'auto' or one of {sorted(DTYPES)}")
        expect(isinstance(self.device, str) and (self.device in (AUTO, "cpu", "cuda") or (
            self.device.split(":")[0] == "cuda" and self.device.split(":")[-1].isdigit())),
               ConfigError, "device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")
        expect(is_int(self.prefill_graph_rows) and self.prefill_graph_rows >= 0, ConfigError, "prefill_graph_rows",
               self.prefill_graph_rows, "an integer >= 0 (0: no prefill graphs)")
        for name in ("max_running_req", "max_num_batched_tokens", "page_size", "cpu_cache_bytes"):
            value = getattr(self, name)
            expect(is_int(value) and value >= 1, ConfigError, name, value, "an integer >= 1")
        ratio = self.memory_ratio
        expect(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1, ConfigError,
               "memory_ratio", ratio, "a number in (0, 1]")
        expect(self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2), ConfigError,
               "max_model_len", self.max_model_len, "None (the model's context) or an integer >= 2")
        expect(self.speculative_algorithm in SPECULATIVE_ALGORITHMS, ConfigError, "speculative_algorithm",
               self.speculative_algorithm, f"one of {SPECULATIVE_ALGORITHMS}")
        if self.speculative_algorithm != "dflash" and self.speculative_draft_model_path:
            raise ConfigError(f"speculative_draft_model_path={self.speculative_draft_model_path!r}: only used with "
                              f"speculative_algorithm 'dflash', got {self.speculative_algorithm!r}")
        if self.speculative_algorithm == "none" and self.speculative_num_steps is not None:
            raise ConfigError(f"speculative_num_steps={self.speculative_num_steps!r}: only used with "
                              "speculative_algorithm 'mtp' or 'dflash'")
        expect(self.speculative_depth in SPECULATIVE_DEPTHS, ConfigError, "speculative_depth", self.speculative_depth,
               f"one of {SPECULATIVE_DEPTHS}")
        expect(self.speculative_num_steps is None or is_int(self.speculative_num_steps), ConfigError,
               "speculative_num_steps", self.speculative_num_steps, "None or an integer (its range is checked at "
               "startup: >= 1 for mtp, 1 .. block_size - 1 for dflash)")
        expect(is_int(self.seed) and 0 <= self.seed < 2**63, ConfigError, "seed", self.seed,
               "an integer in [0, 2^63)")
        expect(self.load_format in LOAD_FORMATS, ConfigError, "load_format", self.load_format,
               f"one of {LOAD_FORMATS}")
        if self.dummy_weight_type is not None:
            expect(self.dummy_weight_type in DUMMY_WEIGHT_TYPES, ConfigError, "dummy_weight_type",
                   self.dummy_weight_type, f"None or one of {DUMMY_WEIGHT_TYPES}")
            expect(self.load_format == "dummy", ConfigError, "dummy_weight_type", self.dummy_weight_type,
                   "only with load_format 'dummy' (a GGUF file's own types are read from it)")
        expect(self.snapshot_interval is None or (is_int(self.snapshot_interval) and self.snapshot_interval >=
               self.page_size and self.snapshot_interval % self.page_size == 0), ConfigError, "snapshot_interval",
               self.snapshot_interval, f"None or a positive multiple of page_size ({self.page_size})")
        expect(self.prefix_snapshots is None or (is_int(self.prefix_snapshots) and self.prefix_snapshots >= 1),
               ConfigError, "prefix_snapshots", self.prefix_snapshots,
               "None (automatic) or an integer >= 1 (turn the cache off with prefix_caching=False)")
        expect(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, ConfigError,
               "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1")
        if self.tensor_parallel_size > 1:
            expect(self.dummy_weight_type is None, ConfigError, "tensor_parallel_size", self.tensor_parallel_size,
                   f"1 with dummy_weight_type {self.dummy_weight_type!r} (GGUF-quantized matrices are not cut "
                   "across ranks)")
            expect(self.device in (AUTO, "cpu", "cuda"), ConfigError, "device", self.device,
                   "'auto', 'cpu' or 'cuda' with tensor_parallel_size > 1 (rank r runs on cuda:r)")
        for name in ("enforce_eager", "prefix_caching", *SPEED_SWITCHES):
            expect(isinstance(getattr(self, name), bool), ConfigError, name, getattr(self, name), "a bool")

    def resolved(self) -> EngineConfig:
        """This config with ``device`` and ``dtype`` ``auto`` resolved for this machine."""
        device = self.device
        if device == AUTO:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(device.split(":")[1]) if ":" in device else 0
            expect(index < count, ConfigError, "device", device,
                   f"'cpu' or 'auto' here: torch {torch.__version__} sees no CUDA device" if count == 0 else
                   f"one of the {count} CUDA devices (cuda:0 .. cuda:{count - 1})")
        dtype = self.dtype
        if dtype == AUTO:
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        return replace(self, device=device, dtype=dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        expect(self.dtype in DTYPES, ConfigError, "dtype", self.dtype, "resolved (call resolved() first)")
        return DTYPES[self.dtype]

    @property
    def prefix_snapshot_interval(self) -> int:
        """Tokens between prefill snapshots: ``snapshot_interval``, or max_num_batched_tokens rounded down to a page."""
        if self.snapshot_interval is not None:
            return self.snapshot_interval
        return max(self.page_size, self.max_num_batched_tokens // self.page_size * self.page_size)

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm != "none"


def _field(name: str):
    return {f.name: f for f in fields(EngineConfig)}[name]


# flags of ``ft generate`` that fill EngineConfig fields (model_path is --model, the spec flags are shared)
ENGINE_FLAGS = ("dtype", "device", "max_running_req", "max_num_batched_tokens", "page_size", "memory_ratio",
                "cpu_cache_bytes", "max_model_len", "load_format", "dummy_weight_type", "speculative_depth", "enforce_eager",
                "prefill_graph_rows", *SPEED_SWITCHES, "prefix_caching", "snapshot_interval", "prefix_snapshots", "tensor_parallel_size")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--dtype``, ``--device``, ... with defaults read from :class:`EngineConfig`."""
    types = {"dtype": str, "device": str, "memory_ratio": float, "load_format": str, "speculative_depth": str,
             "dummy_weight_type": str}
    choices = {"load_format": LOAD_FORMATS, "speculative_depth": SPECULATIVE_DEPTHS,
               "dummy_weight_type": DUMMY_WEIGHT_TYPES}
    for name in ENGINE_FLAGS:
        default = _field(name).default
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):  # --enforce-eager; --side-stream / --no-side-stream, ...
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(flag, action=action, default=default, help=f"fast engine (default: {default})")
            if name == "overlap_schedule":  # SGLang's spelling of --no-overlap-schedule
                parser.add_argument("--disable-overlap-schedule", dest=name, action="store_false",
                                    help="fast engine: the same as --no-overlap-schedule")
            continue
        # vLLM's names for them
        aliases = {"memory_ratio": ["--gpu-memory-utilization"], "tensor_parallel_size": ["--tp"]}.get(name, [])
        parser.add_argument(flag, *aliases, type=types.get(name, int), default=default, choices=choices.get(name),
                            help=f"fast engine (default: {default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig an ``ft generate`` command line asks for (no ``--model``: the bundled pair)."""
    from dflash2.models import resolve_model_paths

    model, draft = resolve_model_paths(args.model, args.speculative_algorithm, args.speculative_draft_model_path)
    return EngineConfig(model_path=model, speculative_algorithm=args.speculative_algorithm,
                        speculative_draft_model_path=draft,
                        speculative_num_steps=args.speculative_num_steps,
                        **{name: getattr(args, name) for name in ENGINE_FLAGS})
