"""Our C++ CPU kernels (``common/kernels/*.cpp``), built on first use with the machine's compiler and
loaded with ctypes.

Why at run time, not in the wheel: the kernels are compiled with ``-march=native`` for the CPU
the node runs on (AVX-512 where it has it, AVX2 where not), and a wheel built once cannot know
that. A build takes under a second (plain C ABI, no torch headers) and is cached, keyed by the
source, the compiler, the flags and the CPU's instruction flags, under ``PDC_KERNEL_CACHE_DIR``
(default ``~/.cache/pdcluster/kernels``). Two processes building at once each write their own
temporary file and rename it into place, so neither loads a half-written library.

The kernels: ``decode_attention.cpp`` (one query per lane over the decode mirror; the torch
attention backend), ``prefill_attention.cpp`` (causal attention of a prompt's new tokens; the
torch attention backend's prefill and extend), ``linear.cpp`` (the projections over weights
blocked by output columns; ``--cpu-linear native``, common/models/linear.py) and
``decode_step.cpp`` (a whole Llama-family decode step; common/models/native_decode.py).

Nothing here is required: without a C++ compiler, with ``PDC_NATIVE_KERNELS=0``, or when a build
fails, ``decode_attention()`` / ``prefill_attention()`` / ``linear()`` / ``decode_step()`` return
None once with a warning and the caller keeps its torch-op, SDPA or oneDNN path (same results up
to rounding, slower; docs/BENCHMARKS.md says by how much).

OpenMP: the library links ``libgomp.so.1``, which the torch CPU build has already loaded under
that name, so the kernel's parallel loops run on torch's OpenMP runtime with the thread count
the caller passes (``torch.get_num_threads()``) instead of starting a second pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from common import envs, hugepages

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# The decode-attention kernel's contract (decode_attention.cpp): head_dim and the mirror's key capacity are
# multiples of this; the backend checks before it calls.
VECTOR_FLOATS = 16

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def cache_dir() -> Path:
    configured = envs.KERNEL_CACHE_DIR.get()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdcluster" / "kernels"


def build(name: str, out_dir: Path | None = None) -> Path:
    """Compile ``<name>.cpp`` of this package (or reuse the cached build); the library's path. Raises
    OSError or subprocess.CalledProcessError / TimeoutExpired when it cannot."""
    cxx = _compiler()
    if cxx is None:
        raise OSError("no C++ compiler (set CXX, or install g++)")
    # The source and every header beside it (the kernels share simd.h, linear.h, attention.h).
    source = b"\0".join([(SOURCE_DIR / f"{name}.cpp").read_bytes(),
                         *(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))])
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(CXX_FLAGS).encode(), _cpu_flags().encode()]))
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{name}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cxx, *CXX_FLAGS, "-o", tmp, str(SOURCE_DIR / f"{name}.cpp")], capture_output=True,
                       text=True, timeout=120, check=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load(name: str, instead: str) -> ctypes.CDLL | None:
    """The built library, or None (logged once per process) when it is off or cannot be built."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib: ctypes.CDLL | None = None
        if not envs.NATIVE_KERNELS.get():
            log.info("native CPU kernels off (PDC_NATIVE_KERNELS=0): %s runs on %s", name, instead)
        else:
            try:
                lib = ctypes.CDLL(str(build(name)))
            except subprocess.CalledProcessError as exc:
                log.warning("building the native kernel %s failed; it runs on %s instead:\n%s", name, instead,
                            (exc.stderr or "")[-2000:])
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("native kernel %s unavailable (%s); it runs on %s instead", name, exc, instead)
        _loaded[name] = lib
        return lib


class DecodeAttention:
    """``pdc_decode_attention`` of decode_attention.cpp with its scratch memory."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.pdc_decode_attention
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                       ctypes.c_int]
        fn.restype = None
        self._fn = fn
        self._scratch = torch.empty(0, dtype=torch.float32)

    @staticmethod
    def supports(q: torch.Tensor, mirror_k: torch.Tensor) -> bool:
        """Whether the kernel takes this layer: float32 queries and mirror on the CPU, head_dim and
        the key capacity in whole vectors (mirror_k: the whole buffer, either key layout)."""
        dim, s_cap = key_dims(mirror_k)
        return (mirror_k.device.type == "cpu" and mirror_k.dtype == torch.float32 and q.dtype == torch.float32
                and dim % VECTOR_FLOATS == 0 and s_cap % VECTOR_FLOATS == 0)

    def __call__(self, q: torch.Tensor, mirror_k: torch.Tensor, mirror_v: torch.Tensor, lens: torch.Tensor,
                 num_lanes: int, scale: float) -> torch.Tensor:
        """softmax(q K^T * scale) V of each lane's one query against its first ``lens[lane]`` keys.
        q: [B, heads, head_dim] float32; mirror_k: [L_cap, kv_heads, head_dim, S_cap] (plain) or
        [L_cap, kv_heads, S_cap / 64, head_dim, 64] (blocked) and mirror_v: [L_cap, kv_heads, S_cap,
        head_dim], the mirror's whole (contiguous) buffers; lens: [B] int32. Returns [B, heads, head_dim]."""
        q = q.contiguous()
        _, heads, dim = q.shape
        kv_heads = mirror_k.shape[1]
        _, s_cap = key_dims(mirror_k)
        assert mirror_k.is_contiguous() and mirror_v.is_contiguous() and lens.dtype == torch.int32
        assert q.shape[0] == num_lanes == lens.shape[0] and heads % kv_heads == 0 and s_cap % VECTOR_FLOATS == 0
        threads = max(1, torch.get_num_threads())
        need = threads * (heads // kv_heads) * (s_cap + dim)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty_like(q)
        self._fn(q.data_ptr(), mirror_k.data_ptr(), mirror_v.data_ptr(), out.data_ptr(), lens.data_ptr(),
                 self._scratch.data_ptr(), num_lanes, heads, kv_heads, dim, s_cap, int(mirror_k.dim() == 5),
                 mirror_k.stride(0), mirror_v.stride(0), scale, threads)
        return out


def key_dims(mirror_k: torch.Tensor) -> tuple[int, int]:
    """(head_dim, S_cap) of a decode mirror's whole key buffer, plain [L, kv_heads, head_dim, S_cap]
    or blocked [L, kv_heads, S_cap / 64, head_dim, 64] (attention.h)."""
    if mirror_k.dim() == 5:
        return mirror_k.shape[3], mirror_k.shape[2] * mirror_k.shape[4]
    return mirror_k.shape[2], mirror_k.shape[3]


def decode_attention() -> DecodeAttention | None:
    """The decode-attention kernel for this process, or None (torch ops then)."""
    lib = _load("decode_attention", "torch ops")
    return None if lib is None else DecodeAttention(lib)


class PrefillAttention:
    """``pdc_prefill_attention`` of prefill_attention.cpp: causal attention of G requests' E new
    tokens each after the same cached prefix."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.pdc_prefill_attention
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
        """float32 queries and keys on the CPU, head_dim in whole vectors."""
        return (q.device.type == keys.device.type == "cpu" and q.dtype == keys.dtype == torch.float32
                and q.shape[-1] % VECTOR_FLOATS == 0)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, prefix: int,
                 scale: float) -> torch.Tensor:
        """q: [G, E, heads, head_dim]; keys, vals: [G, prefix + E, kv_heads, head_dim]. Token t of each
        request sits at position prefix + t and sees keys 0 .. prefix + t. Returns [G, E, heads, head_dim]."""
        q, keys, vals = q.contiguous(), keys.contiguous(), vals.contiguous()
        g, e, heads, dim = q.shape
        kv_heads = keys.shape[2]
        assert keys.shape == vals.shape == (g, prefix + e, kv_heads, dim) and heads % kv_heads == 0
        out = torch.empty_like(q)
        self._fn(q.data_ptr(), keys.data_ptr(), vals.data_ptr(), out.data_ptr(), g, e, prefix, heads, kv_heads, dim,
                 scale, max(1, torch.get_num_threads()))
        return out


def prefill_attention() -> PrefillAttention | None:
    """The prefill-attention kernel for this process, or None (SDPA then)."""
    lib = _load("prefill_attention", "SDPA")
    return None if lib is None else PrefillAttention(lib)


class Linear:
    """``pdc_linear`` of linear.cpp: y = x W^T (+ bias) over a weight ``pack``ed for it."""

    BLOCK = 32  # output columns per block (linear.cpp's NB)

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.pdc_linear
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
        fn.restype = None
        self._fn = fn

    @classmethod
    def packed_numel(cls, n: int, k: int) -> int:
        """Elements of an [n, k] weight's packed copy (its columns padded to whole blocks)."""
        return -(-n // cls.BLOCK) * cls.BLOCK * k

    @classmethod
    def pack(cls, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """weight [N, K] float32 -> [ceil(N / BLOCK), K, BLOCK], the columns past N zero. ``out``: a
        contiguous buffer of ``packed_numel`` elements to pack into (a slice of one arena for all of
        a model's projections, ``common.models.linear.pack_linears``), else a buffer of its own."""
        n, k = weight.shape
        blocks = -(-n // cls.BLOCK)
        padded = weight.new_zeros(blocks * cls.BLOCK, k)
        padded[:n] = weight
        # Streamed whole every decode step: in 2-MiB pages (common/hugepages.py says why).
        if out is None:
            packed = hugepages.zeros((blocks, k, cls.BLOCK), weight.dtype)
        else:
            assert out.is_contiguous() and out.numel() == blocks * k * cls.BLOCK and out.dtype == weight.dtype
            packed = out.view(blocks, k, cls.BLOCK)
        packed.copy_(padded.view(blocks, cls.BLOCK, k).transpose(1, 2))
        return packed

    def __call__(self, x: torch.Tensor, blocks: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 (rows may be strided, columns not) times the packed weight: [M, N]."""
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        assert blocks.shape[1] == k and blocks.dtype == x.dtype == torch.float32
        out = torch.empty(m, out_features, dtype=torch.float32)
        if bias is not None:
            bias = bias.contiguous()
        self._fn(x.data_ptr(), m, k, x.stride(0), blocks.data_ptr(), out_features,
                 None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                 max(1, torch.get_num_threads()))
        return out


def linear() -> Linear | None:
    """The projection kernel for this process, or None (oneDNN's or MKL's then)."""
    lib = _load("linear", "oneDNN / MKL")
    return None if lib is None else Linear(lib)


class DecodeStep:
    """``pdc_decode_step`` of decode_step.cpp: a whole decode step of a Llama-family model. The
    caller (common/models/native_decode.py) fills ``Layer`` once per set of buffers, ``Shape``
    once per mirror capacity and ``Model`` once."""

    class Layer(ctypes.Structure):  # decode_step.cpp's ``Layer``, field for field
        _fields_ = [(name, ctypes.c_void_p) for name in (
            "input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
            "gate_up_bias", "down", "down_bias", "k_pool", "v_pool", "k_mirror", "v_mirror")]

    class Shape(ctypes.Structure):  # decode_step.cpp's ``Shape``
        _fields_ = [*((name, ctypes.c_int64) for name in (
            "layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "s_cap", "blocked_keys")),
            ("eps", ctypes.c_float), ("scale", ctypes.c_float)]

    class Model(ctypes.Structure):  # decode_step.cpp's ``Model``
        _fields_ = [("embed", ctypes.c_void_p), ("embed_rows", ctypes.c_int64), ("embed_packed", ctypes.c_int64),
                    ("inv_freq", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p),
                    ("vocab", ctypes.c_int64)]

    MAX_HEAD_DIM = 512  # decode_step.cpp's per-head buffer

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        step = lib.pdc_decode_step
        step.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        step.restype = ctypes.c_int
        scratch = lib.pdc_decode_step_scratch
        scratch.argtypes = [ptr, i64, ctypes.c_int]
        scratch.restype = i64
        self._step, self._scratch_floats = step, scratch

    def scratch_floats(self, shape: "DecodeStep.Shape", batch: int, threads: int) -> int:
        return int(self._scratch_floats(ctypes.byref(shape), batch, threads))

    def __call__(self, layers: ctypes.Array, shape: "DecodeStep.Shape", model: "DecodeStep.Model", ids: torch.Tensor,
                 slots: torch.Tensor, lanes: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                 scratch: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids [B] -> the final norm's output [B, hidden] and, where ``model`` has a head,
        the logits [B, vocab] (None otherwise). slots, lanes, positions, lens [B] int64 (all
        contiguous, CPU). Raises ValueError, nothing written, for an id outside the embedding."""
        b = ids.shape[0]
        out = torch.empty(b, shape.hidden, dtype=torch.float32)
        logits = torch.empty(b, model.vocab, dtype=torch.float32) if model.head else None
        rc = self._step(ctypes.addressof(layers), ctypes.addressof(shape), ctypes.addressof(model), b, ids.data_ptr(),
                        slots.data_ptr(), lanes.data_ptr(), positions.data_ptr(), lens.data_ptr(), out.data_ptr(),
                        None if logits is None else logits.data_ptr(), scratch.data_ptr(), threads)
        if rc != 0:
            raise ValueError(f"decode step: a token id outside the embedding's {model.embed_rows} rows: {ids.tolist()}")
        return out, logits


def decode_step() -> DecodeStep | None:
    """The whole-step decode kernel for this process, or None (the layers' own path then)."""
    lib = _load("decode_step", "the layer-by-layer path")
    return None if lib is None else DecodeStep(lib)
