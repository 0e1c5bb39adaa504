"""A capture-safe NCCL communicator: NCCL's C API called through ctypes, on the caller's current CUDA stream.

Why not ``torch.distributed``'s NCCL process group: it keeps host-side state per collective (work objects, events,
sequence numbers for its watchdog), which a CUDA graph does not replay, so a captured step of the sharded target
cannot hold its collectives (vLLM and SGLang capture theirs through the same kind of raw binding, their
``pynccl``). A collective here is one ``ncclAllReduce`` / ``ncclAllGather`` call enqueued on
``torch.cuda.current_stream()``: eagerly it runs in stream order with the step's kernels, and under capture it
becomes a node of the graph, replayed with it.

The library: the ``libnccl.so.2`` the CUDA build of torch already loaded (its ``nvidia-nccl`` wheel), found by
soname, else in that wheel's folder on ``sys.path``. The unique id that joins the ranks travels over
an existing (gloo) process group: :meth:`NcclComm.create`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor

NCCL_UNIQUE_ID_BYTES = 128
NCCL_SUM = 0
# ncclDataType_t (nccl.h)
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
               torch.float64: 8, torch.bfloat16: 9}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _library_paths() -> list[str]:
    paths = ["libnccl.so.2"]  # already loaded by torch's CUDA libraries: dlopen finds it by soname
    for root in sys.path:
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*")))
    return paths


def load_library() -> ctypes.CDLL:
    """NCCL's shared library with the signatures used here; RuntimeError naming every path tried."""
    errors = []
    for path in _library_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    else:
        raise RuntimeError("NCCL library not found (a CUDA build of torch ships it in its nvidia-nccl wheel); "
                           "tried " + "; ".join(errors))
    c_int, c_size_t, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [c_int]
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, NcclUniqueId, c_int]
    lib.ncclAllReduce.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    lib.ncclAllGather.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p]
    lib.ncclCommDestroy.argtypes = [c_void_p]
    for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclAllGather",
                 "ncclCommDestroy"):
        getattr(lib, name).restype = c_int
    return lib


class NcclComm:
    """One rank's NCCL communicator over ``size`` ranks (each process one CUDA device)."""

    def __init__(self, lib: ctypes.CDLL, unique_id: bytes, rank: int, size: int, device: torch.device):
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id: {len(unique_id)} bytes, expected {NCCL_UNIQUE_ID_BYTES}")
        self.lib, self.rank, self.size, self.device = lib, rank, size, device
        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank), "ncclCommInitRank")

    @classmethod
    def create(cls, rank: int, size: int, device: torch.device, group: dist.ProcessGroup | None = None) -> NcclComm:
        """Rank 0 makes the unique id and broadcasts it over ``group`` (a CPU-capable group: gloo); every rank
        joins. Collective over ``group``'s ranks."""
        lib = load_library()
        box = [None]
        if rank == 0:
            uid = NcclUniqueId()
            _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            box[0] = bytes(uid.internal)
        dist.broadcast_object_list(box, src=0, group=group)
        return cls(lib, box[0], rank, size, device)

    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def _check(self, result: int, call: str) -> None:
        _check(self.lib, result, call)

    def _dtype(self, x: Tensor) -> int:
        if x.dtype not in NCCL_DTYPES:
            raise TypeError(f"NCCL collective of dtype {x.dtype}: expected one of {sorted(map(str, NCCL_DTYPES))}")
        if x.device != self.device or not x.is_contiguous():
            raise ValueError(f"NCCL collective: expected a contiguous tensor on {self.device}, got {x.device} "
                             f"(contiguous={x.is_contiguous()})")
        return NCCL_DTYPES[x.dtype]

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks, in place, on the current stream."""
        dtype = self._dtype(x)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self.lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), dtype, NCCL_SUM, self.comm,
                                           ctypes.c_void_p(stream)), "ncclAllReduce")
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """``[size, *x.shape]``: every rank's ``x`` in rank order, on the current stream."""
        dtype = self._dtype(x)
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self.lib.ncclAllGather(x.data_ptr(), out.data_ptr(), x.numel(), dtype, self.comm,
                                           ctypes.c_void_p(stream)), "ncclAllGather")
        return out

    def close(self) -> None:
        if self.comm:
            self._check(self.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")
            self.comm = ctypes.c_void_p()


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: NCCL error {result} ({lib.ncclGetErrorString(result).decode()})")
