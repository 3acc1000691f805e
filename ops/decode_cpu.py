"""The decode step as one C call on CPU (ops/csrc/decode_cpu.c), for the embedded engine's generate loop.

At batch 32 on the tiny model a torch decode step is ~100 ops of 5-10 us dispatch each around
~0.7 ms of GEMM: the overhead is most of the step. The C kernel runs the same decoder (the same
weights, cache layout and rope tables) with its GEMMs on the BLAS torch links (sgemm_), or up to 8
rows on its own few-row GEMM (one pass over each weight for all rows), and everything else as plain
loops, so a step costs about its GEMMs. A plan can carry several tokens a row (block_step: the k+1
tokens of a speculative verify, causal within the block), which at 1-8 rows costs little more than
one, as it streams the same weights. Its reductions (norms, attention)
run in another order than torch's, so its logits equal the reference forward's to float32 rounding,
not bit for bit: ops.INVARIANT never uses it (mode="invariant" keeps the torch kernels).

The library is compiled on first use with the system C compiler (about a second) into a cache
keyed by the source, the flags, the machine and torch's library; where no compiler, no CPU BLAS
symbol or no CPU tensors are at hand, `status` says why and generate keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ops.rope import rope_tables

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "decode_cpu.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-Wl,--no-undefined")

_P = ctypes.POINTER(ctypes.c_float)
_PP = ctypes.POINTER(_P)
_LAYER_WEIGHTS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "wgu", "w_down")
_PACKED = ("wqkv", "wo", "wgu", "w_down")  # the layer matrices mf_pack takes (and the output layer)
# From 2 rows MKL's sgemm re-packs each weight panel at every call; one row is a GEMV, which does not.
# MILES_FN_DECODE_PACK=0 turns the packing off (for comparisons).
PACK_MIN_ROWS = 2


def _flags() -> tuple[str, ...]:
    """The compiler flags. For comparisons (the same bits): MILES_FN_DECODE_WIDE=0 builds the few-row GEMM's
    8-float pairs loop even where AVX-512 would take the 16-float one; MILES_FN_DECODE_PREFETCH=<bytes> sets
    how far ahead it prefetches its weights."""
    extra = ("-DMF_NARROW_PAIRS",) if os.environ.get("MILES_FN_DECODE_WIDE") == "0" else ()
    if ahead := os.environ.get("MILES_FN_DECODE_PREFETCH"):
        if not ahead.isdigit():
            raise ValueError(f"MILES_FN_DECODE_PREFETCH must be a byte count, got {ahead!r}")
        extra += (f"-DPREFETCH_AHEAD={ahead}",)
    return _FLAGS + extra


class _Model(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int64) for n in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                        "layers", "max_len", "n_new")]
        + [("eps", ctypes.c_float), ("embed", _P), ("final_norm", _P), ("lm_head", _P)]
        + [(n, _PP) for n in _LAYER_WEIGHTS]
        + [("k_cache", _PP), ("v_cache", _PP), ("key_valid", ctypes.POINTER(ctypes.c_uint8)),
           ("cos", _P), ("sin", _P)]
        + [(n, _P) for n in ("x", "h", "qkv", "att", "gu", "scores")]
        + [("lm_head_p", _P)] + [(f"{n}_p", _PP) for n in _PACKED]
        + [("block", ctypes.c_int64), ("small_rows", ctypes.c_int64)]
        + [("lm_head_i", _P)] + [(f"{n}_i", _PP) for n in _PACKED]
    )


def _cache_dir() -> str:
    return os.environ.get("MILES_FN_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "miles_fn"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not). Built once per source/machine, then loaded from the cache."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc/gcc) on PATH"
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    with open(_SOURCE, "rb") as f:
        src = f.read()
    flags = _flags()
    tag = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), torch_lib.encode(), torch.__version__.encode(),
                                     platform.machine().encode(), _cpu_model().encode()])).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"decode_cpu-{tag}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, _SOURCE, f"-L{torch_lib}", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            return None, f"compiling {_SOURCE} failed: {e}"
        if done.returncode != 0:
            os.unlink(tmp)
            return None, f"compiling {_SOURCE} failed ({' '.join(cmd)}): {done.stderr.strip()[-500:]}"
        os.replace(tmp, path)  # atomic: a concurrent process sees the whole library or none
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"loading {path} failed: {e}"
    lib.mf_decode_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                   ctypes.c_int64, _P]
    lib.mf_decode_step.restype = ctypes.c_int
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.mf_block_step.argtypes = [ctypes.POINTER(_Model), i64p, i64p, ctypes.c_int64, _P, i64p, ctypes.c_int64,
                                  ctypes.c_int]
    lib.mf_block_step.restype = ctypes.c_int
    lib.mf_sample_rows.argtypes = [ctypes.c_int64, ctypes.c_int64, _P, ctypes.POINTER(ctypes.c_double),
                                   ctypes.c_float, i64p, _P, _P]
    lib.mf_sample_rows.restype = None
    lib.mf_generate.argtypes = [ctypes.POINTER(_Model), _P, ctypes.POINTER(ctypes.c_double), ctypes.c_float, i64p,
                                ctypes.c_int64, ctypes.c_int64, i64p, _P, i64p, _P,
                                ctypes.POINTER(ctypes.c_uint8), i64p]
    lib.mf_generate.restype = ctypes.c_int
    lib.mf_pack_available.argtypes = []
    lib.mf_pack_available.restype = ctypes.c_int
    lib.mf_pack_size.argtypes = [ctypes.c_int64] * 3
    lib.mf_pack_size.restype = ctypes.c_int64
    lib.mf_pack.argtypes = [ctypes.c_int64] * 3 + [_P, _P]
    lib.mf_pack.restype = None
    lib.mf_small_rows.argtypes = []
    lib.mf_small_rows.restype = ctypes.c_int64
    lib.mf_blocked_rows.argtypes = []
    lib.mf_blocked_rows.restype = ctypes.c_int64
    lib.mf_wide_pairs.argtypes = []
    lib.mf_wide_pairs.restype = ctypes.c_int
    lib.mf_fma_peak.argtypes = [ctypes.c_int64, _P]
    lib.mf_fma_peak.restype = ctypes.c_double
    lib.mf_max_head_dim.argtypes = []
    lib.mf_max_head_dim.restype = ctypes.c_int64
    return lib, ""


def status() -> str:
    """"" when the kernel can run on this machine, else why not (builds it on first call)."""
    return _library()[1]


def _ptr(t: torch.Tensor | None) -> Any:
    return None if t is None else ctypes.cast(t.data_ptr(), _P)


def _ptrs(ts: list[torch.Tensor | None]) -> Any:
    return (_P * len(ts))(*[_ptr(t) for t in ts])


def applies(params: dict[str, Any], cache: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the kernel can take this model and cache: float32, on CPU, the cache contiguous."""
    tensors = [params["embed"], params["final_norm"], *(c for kv in cache for c in kv)]
    tensors += [w for layer in params["layers"] for w in layer.values()]
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and all(
        c.is_contiguous() for kv in cache for c in kv)


def unsupported(params: dict[str, Any]) -> str:
    """"" when the kernel implements this model's layers, else why not: it has no Qwen3 q/k norms and
    no MoE MLP, so those models decode on the torch path (model.forward), which has both."""
    keys = {k for layer in params["layers"] for k in layer}
    if "router" in keys:
        return "the model has MoE layers (Qwen3-MoE), which the C kernel does not implement"
    if "q_norm" in keys:
        return "the model has Qwen3 per-head q/k norms, which the C kernel does not implement"
    return ""


def can_take(cfg: Any, params: dict[str, Any], cache: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the kernel can run this model under ops config `cfg` (an ops.OpsConfig), never raising: the
    prefill's test (generate takes the kernel there where it can, under "auto" and "cpu_kernel" alike), and
    "auto"'s for decoding."""
    plain = not cfg.invariant and not cfg.compile and cfg.attention_backend == "torch" and cfg.gemm_backend == "torch"
    return (cfg.decode_backend != "torch" and plain and not unsupported(params) and applies(params, cache)
            and not status())


def chosen(cfg: Any, params: dict[str, Any], cache: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether generate decodes with this kernel under ops config `cfg` (an ops.OpsConfig).

    "auto" takes it where it can run (reference mode, torch backends, CPU float32, a build here);
    "cpu_kernel" insists, and fails naming what is missing.
    """
    if cfg.decode_backend != "cpu_kernel":
        return can_take(cfg, params, cache)
    if why := unsupported(params):
        raise ValueError(f"--decode_backend=cpu_kernel cannot take this model: {why}; use --decode_backend=auto "
                         "or torch")
    if not applies(params, cache):
        raise ValueError("--decode_backend=cpu_kernel takes float32 weights and caches on CPU; "
                         "use --decode_backend=auto or torch for other dtypes and devices")
    if why := status():
        raise RuntimeError(f"--decode_backend=cpu_kernel cannot run here: {why}")
    return True


def _stacked(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """A layer's weights as the kernel takes them: q/k/v stacked into one GEMM, gate/up into another.

    The copy buys one GEMM where there were three and two: a GEMM of 32 rows costs ~10 us of call overhead
    on top of its FLOPs. It is made once per weights (_derived), not per generate call.
    """
    bias = None if layer.get("bq") is None else torch.cat([layer["bq"], layer["bk"], layer["bv"]]).contiguous()
    return {"attn_norm": layer["attn_norm"].contiguous(),
            "wqkv": torch.cat([layer["wq"], layer["wk"], layer["wv"]]).contiguous(), "bqkv": bias,
            "wo": layer["wo"].contiguous(), "mlp_norm": layer["mlp_norm"].contiguous(),
            "wgu": torch.cat([layer["w_gate"], layer["w_up"]]).contiguous(), "w_down": layer["w_down"].contiguous()}


# What the kernel derives from a weight tensor (the stacked layer, packed panels), kept while that tensor
# lives: an engine's calls between two weight syncs share one copy (on SmolLM2-135M the stacking alone
# was ~30 ms a call, more than a decode step). Keyed weakly by the tensor the entry derives from, and
# checked against every source tensor by identity (a weak reference) and _version: a replaced tensor
# (a weight sync's new tensors) or one written in place (copy_, load) remakes the entry. A write that
# bypasses the version counter (through .data, numpy or ctypes) is not seen; nothing here writes weights
# so. Entries no plan has used in the last _KEEP_PLANS plan builds are dropped (the run's first weights,
# kept alive as the KL reference, would otherwise pin their copies all run). A memo of a pure function
# of the weights, not state; one lock, as an engine may build plans on two threads.
_DERIVED = WeakTensorKeyDictionary()  # owner tensor -> [its sources' (ref, _version), last plan, {what: derived}]
_PACKED_ROW_COUNTS = 2  # packed panels kept per weight: one per GEMM row count, the most recent ones
_KEEP_PLANS = 32  # a speculative call: 4 decode plans (target's two, draft's two), and up to 2 for each prefill
# forward of either model (prefill: the full pieces' and the remainder's; a shared turn is a forward of its own)
_LOCK = threading.Lock()
_plans_built = 0


def _derived(owner: torch.Tensor, sources: list[torch.Tensor | None], what: Any, make: Any, plan: int) -> Any:
    """make(), memoised under `owner` for `what` ("stacked", "pairs", or an int: panels packed for that many GEMM
    rows, the last _PACKED_ROW_COUNTS of them kept) while every tensor of `sources` is the same, unchanged.
    `plan`: the building plan's number (_next_plan)."""
    srcs = [t for t in sources if t is not None]
    with _LOCK:
        entry = _DERIVED.get(owner)
        if entry is None or len(entry[0]) != len(srcs) or any(
                r() is not t or v != t._version for (r, v), t in zip(entry[0], srcs, strict=True)):
            entry = [[(weakref.ref(t), t._version) for t in srcs], plan, {}]
            _DERIVED[owner] = entry
        entry[1] = plan
        memo = entry[2]
        if what not in memo:
            if isinstance(what, int):  # packed panels (keyed by their row count): each set is the weights' size
                counts = [w for w in memo if isinstance(w, int)]  # insertion order: the oldest first
                for w in counts[: max(0, len(counts) + 1 - _PACKED_ROW_COUNTS)]:
                    del memo[w]
            memo[what] = make()
        return memo[what]


def _next_plan() -> int:
    """A new plan's number; entries unused by the last _KEEP_PLANS plans are dropped first."""
    global _plans_built
    with _LOCK:
        _plans_built += 1
        stale = [o for o, entry in _DERIVED.items() if entry[1] < _plans_built - _KEEP_PLANS]
        for o in stale:
            del _DERIVED[o]
        return _plans_built


def _layer_sources(layer: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    return [layer.get(n) for n in ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "mlp_norm", "w_gate",
                                   "w_up", "w_down")]


def stacked_layer(layer: dict[str, torch.Tensor], plan: int) -> dict[str, torch.Tensor | None]:
    """_stacked(layer), made once while the layer's weights are unchanged."""
    return _derived(layer["wq"], _layer_sources(layer), "stacked", lambda: _stacked(layer), plan)


def _pack(lib: ctypes.CDLL, w: torch.Tensor, rows: int) -> torch.Tensor:
    """w [n, k] packed by MKL for products x [rows, k] @ w.T (a float32 buffer of MKL's size)."""
    n, k = w.shape
    buf = torch.empty((lib.mf_pack_size(rows, n, k) + 3) // 4)
    lib.mf_pack(rows, n, k, _ptr(w), _ptr(buf))
    return buf


def interleave_pairs(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] (k a multiple of 8) as the few-row GEMM streams it: rows 2i and 2i+1 side by side in chunks
    of 8 ([n // 2, k // 8, 2, 8]), an odd last row plainly at the end; flat.

    Two weight rows a pass halve the few-row GEMM's loads of its input, and this order keeps the weights
    one sequential stream: on SmolLM2-135M a 4-token verify at batch 1 went from 2.0x to 1.6x a 1-row step
    (37.2 -> 26.9 ms; docs/speculative-decoding.md).
    """
    n, k = w.shape
    if k % 8:
        raise ValueError(f"interleave_pairs: the row length must be a multiple of 8, got {k}")
    n2 = n - n % 2
    body = w[:n2].reshape(n2 // 2, 2, k // 8, 8).transpose(1, 2).reshape(-1)
    return torch.cat([body, w[n2:].reshape(-1)]) if n2 < n else body  # reshape of the transpose: a copy


def pairs_on(lib: ctypes.CDLL) -> bool:
    """Whether plans give the few-row GEMM its weights in pairs (interleave_pairs): a copy of every matrix,
    made once per weights. MILES_FN_DECODE_PAIRS=0 reads the plain matrices instead (the same results, bit
    for bit; for comparisons)."""
    return os.environ.get("MILES_FN_DECODE_SMALL_GEMM") != "0" and os.environ.get("MILES_FN_DECODE_PAIRS") != "0"


def small_rows(lib: ctypes.CDLL) -> int:
    """Up to how many rows the kernel's own GEMM takes a product: 1-8 in one pass over each weight for all
    rows (where BLAS's small-M kernels cost far more), and on the paired weights up to mf_blocked_rows in
    chunks of 8 over L2-sized blocks of them (MKL's packed GEMM ran 24-44 rows at ~60 GFLOP/s here).
    MILES_FN_DECODE_SMALL_GEMM=0: none; MILES_FN_DECODE_BLOCKED=0: 8 at most (for comparisons)."""
    if os.environ.get("MILES_FN_DECODE_SMALL_GEMM") == "0":
        return 0
    blocked = pairs_on(lib) and os.environ.get("MILES_FN_DECODE_BLOCKED") != "0"
    return int(lib.mf_blocked_rows() if blocked else lib.mf_small_rows())


def packs(lib: ctypes.CDLL, rows: int) -> bool:
    """Whether a plan of `rows` GEMM rows packs its weights for BLAS (not where the few-row GEMM takes them)."""
    return (rows >= PACK_MIN_ROWS and rows > small_rows(lib) and bool(lib.mf_pack_available())
            and os.environ.get("MILES_FN_DECODE_PACK") != "0")


def _i64(t: torch.Tensor) -> Any:
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int64))


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's sampler (what DecodePlan.generate samples with) on logits [R, V], one float64 uniform
    a row (None: greedy): (tokens [R] int64, log-probs [R] float32)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is unavailable: {why}")
    logits = logits.to(torch.float32).contiguous()
    r, v = logits.shape
    up = None
    if uniforms is not None:
        uniforms = uniforms.to(torch.float64).contiguous()
        if uniforms.shape != (r,):
            raise ValueError(f"sample_rows: uniforms must be [{r}], got {tuple(uniforms.shape)}")
        up = ctypes.cast(uniforms.data_ptr(), ctypes.POINTER(ctypes.c_double))
    tok, lp, work = torch.empty(r, dtype=torch.int64), torch.empty(r), torch.empty(2 * v)
    lib.mf_sample_rows(r, v, _ptr(logits), up, temperature, _i64(tok), _ptr(lp), _ptr(work))
    return tok, lp


class DecodePlan:
    """The kernel's view of one generate call: pointers to the weights, caches and tables, plus scratch.

    It holds the tensors it points to, so nothing it names is freed while it lives; the caches are
    the caller's and are written in place, as model.forward writes them. A uint8 contiguous key_valid
    is the caller's too, read at every step (a speculative round edits it between steps); any other
    is copied once. `block` is the tokens per row each step carries (block_step; step needs 1). pack=False
    never packs the weights for BLAS (a prefill's row count varies from call to call, and each count would
    keep its own packed copy of every matrix).
    """

    def __init__(self, params: dict[str, Any], cfg: Any, cache: list[tuple[torch.Tensor, torch.Tensor]],
                 key_valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: int = 1, pack: bool = True):
        lib, why = _library()
        if lib is None:
            raise RuntimeError(f"the CPU decode kernel is unavailable: {why}")
        if cfg.dim_head > (limit := lib.mf_max_head_dim()):
            raise ValueError(f"the CPU decode kernel takes head_dim <= {limit}, got {cfg.dim_head}")
        if block < 1:
            raise ValueError(f"DecodePlan: block must be >= 1, got {block}")
        self._lib = lib
        b, s = key_valid.shape
        m = b * block  # rows of every GEMM
        d, nq, nkv = cfg.dim_head, cfg.num_heads * cfg.dim_head, cfg.num_kv_heads * cfg.dim_head
        plan = _next_plan()
        layers = [stacked_layer(layer, plan) for layer in params["layers"]]
        head_src = params.get("lm_head", params["embed"])  # what the head's derived copies are memoised under
        head = head_src.contiguous()
        self._keep: list[Any] = [layers, head, params["embed"].contiguous(), params["final_norm"].contiguous()]
        self.key_valid = key_valid.to(torch.uint8).contiguous()
        self.cos, self.sin = cos.contiguous(), sin.contiguous()  # [B, n_new, D]
        scratch = {n: torch.empty(m, w) for n, w in (("x", cfg.hidden_size), ("h", cfg.hidden_size),
                                                      ("qkv", nq + 2 * nkv), ("att", nq),
                                                      ("gu", 2 * cfg.intermediate_size))}
        scratch["scores"] = torch.empty(s)
        self.logits = torch.empty(m, cfg.vocab_size)
        self._keep += [scratch, cache]
        arrays = {n: _ptrs([layer[n] for layer in layers]) for n in _LAYER_WEIGHTS}
        arrays["k_cache"] = _ptrs([k for k, _ in cache])
        arrays["v_cache"] = _ptrs([v for _, v in cache])
        self._keep.append(arrays)
        self._model = _Model(
            rows=b, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=d,
            inter=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_layers, max_len=s,
            n_new=cos.shape[1], eps=cfg.rms_norm_eps, embed=_ptr(self._keep[2]), final_norm=_ptr(self._keep[3]),
            lm_head=_ptr(head),
            key_valid=ctypes.cast(self.key_valid.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
            cos=_ptr(self.cos), sin=_ptr(self.sin), block=block, small_rows=small_rows(lib), **arrays,
            **{n: _ptr(t) for n, t in scratch.items()})
        if pack and packs(lib, m):  # once per weights and row count: ~one pass over them, then every step skips it
            per_layer = [_derived(src["wq"], _layer_sources(src), m,
                                  lambda layer=layer: {n: _pack(lib, layer[n], m) for n in _PACKED}, plan)
                         for src, layer in zip(params["layers"], layers, strict=True)]
            packed = {n: [p[n] for p in per_layer] for n in _PACKED}
            head_p = _derived(head_src, [head_src], m, functools.partial(_pack, lib, head, m), plan)
            self._keep += [packed, head_p]
            parrays = {f"{n}_p": _ptrs(ts) for n, ts in packed.items()}
            self._keep.append(parrays)
            for n, v in parrays.items():
                setattr(self._model, n, v)
            self._model.lm_head_p = _ptr(head_p)
        if pairs_on(lib):  # the few-row GEMM's copies, once per weights; a matrix whose rows are not 8k stays plain
            per_layer = [_derived(src["wq"], _layer_sources(src), "pairs",
                                  lambda layer=layer: {n: interleave_pairs(layer[n]) for n in _PACKED
                                                       if layer[n].shape[1] % 8 == 0}, plan)
                         for src, layer in zip(params["layers"], layers, strict=True)]
            head_i = (_derived(head_src, [head_src], "pairs", lambda: interleave_pairs(head), plan)
                      if cfg.hidden_size % 8 == 0 else None)
            self._keep += [per_layer, head_i]
            for n in _PACKED:
                if n in per_layer[0]:
                    ptrs = _ptrs([p[n] for p in per_layer])
                    self._keep.append(ptrs)
                    setattr(self._model, f"{n}_i", ptrs)
            self._model.lm_head_i = _ptr(head_i)
        self.packed = pack and packs(lib, m)
        self.few_rows = m <= self._model.small_rows  # every product in the kernel's own GEMM (few-row or blocked)
        self._logits_ptr = _ptr(self.logits)
        self._work = torch.empty(2 * cfg.vocab_size)
        self._work_ptr = _ptr(self._work)

    def step(self, tokens: torch.Tensor, t: int, col: int) -> torch.Tensor:
        """Logits [B, V] for tokens [B] (int64) at decode step t, their keys/values going to cache column col.

        The returned tensor is the plan's buffer, overwritten by the next step.
        """
        if self._model.block != 1:
            raise ValueError(f"decode step: this plan carries {self._model.block} tokens a row; use block_step")
        tokens = tokens.contiguous()
        if tokens.dtype != torch.int64 or tokens.shape != (self._model.rows,):
            raise ValueError(f"decode step: tokens must be int64 of shape [{self._model.rows}], "
                             f"got {tokens.dtype} {tuple(tokens.shape)}")
        rc = self._lib.mf_decode_step(ctypes.byref(self._model),
                                      ctypes.cast(tokens.data_ptr(), ctypes.POINTER(ctypes.c_int64)), t, col,
                                      self._logits_ptr)
        if rc == 2:
            raise ValueError(f"decode step {t}: a token id is outside the vocabulary [0, {self._model.vocab})")
        if rc != 0:
            raise ValueError(f"decode step {t} (cache column {col}) is outside the plan "
                             f"({self._model.n_new} steps, {self._model.max_len} columns)")
        return self.logits

    def block_step(self, tokens: torch.Tensor, t0: torch.Tensor, col: int, rows: torch.Tensor | None = None,
                   head: bool = True, last_only: bool = False) -> torch.Tensor | None:
        """Logits [R, T, V] for tokens [R, T] (T = block) of the plan's rows `rows` (int64 [R], distinct;
        None: all B, in order): row rows[i]'s token j goes to its cache column col + j at its rope entry
        t0[i] + j and attends the columns 0..col + j that key_valid allows (mark the block's columns valid
        first for a causal block). Rows left out are not computed and their caches are not touched: the
        rows that have finished cost nothing. The plan's buffer, overwritten by the next step. head=False
        fills the caches only and returns None: the output layer (SmolLM2's 49k rows) is skipped; last_only
        gives the logits [R, V] of each row's last token alone (a prefill's)."""
        b, blk = self._model.rows, self._model.block
        n = b if rows is None else int(rows.shape[0])
        tokens = tokens.to(torch.int64).contiguous()
        t0 = t0.to(torch.int64).contiguous()
        if tokens.shape != (n, blk) or t0.shape != (n,):
            raise ValueError(f"block step: tokens must be [{n}, {blk}] and t0 [{n}], got {tuple(tokens.shape)} and "
                             f"{tuple(t0.shape)}")
        rp = None
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            if rows.dim() != 1 or (n and (int(rows.min()) < 0 or int(rows.max()) >= b)) or rows.unique().numel() != n:
                raise ValueError(f"block step: rows must be distinct indices in [0, {b}), got {rows.tolist()}")
            rp = _i64(rows)
        rc = self._lib.mf_block_step(ctypes.byref(self._model), _i64(tokens), _i64(t0), col,
                                     self._logits_ptr if head else None, rp, n, int(last_only))
        if rc == 2:
            raise ValueError(f"block step: a token id is outside the vocabulary [0, {self._model.vocab})")
        if rc != 0:
            raise ValueError(f"block step at cache column {col}, rope entries {t0.tolist()} + {blk} lies outside the "
                             f"plan ({self._model.n_new} entries, {self._model.max_len} columns)")
        if not head:
            return None
        return self.logits[:n] if last_only else self.logits[: n * blk].view(n, blk, -1)

    def generate(self, logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float,
                 stop_token_ids: tuple[int, ...], first_col: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """generate's whole decode loop in one C call, for sampling without top-k/top-p.

        logits [B, V]: the prefill's last column; uniforms [n_new, B] float64 (None: greedy); step t's
        tokens go to cache column first_col + t. Returns (tokens [B, n_new], log-probs [B, n_new], counts [B])
        as generate's loop makes them: rows past their stop token hold 0.
        """
        b, v, n = self._model.rows, self._model.vocab, self._model.n_new
        if self._model.block != 1:
            raise ValueError(f"decode generate: this plan carries {self._model.block} tokens a row; it needs 1")
        if logits.shape != (b, v):
            raise ValueError(f"decode generate: logits must be [{b}, {v}], got {tuple(logits.shape)}")
        self.logits.copy_(logits)
        up = None
        if uniforms is not None:
            if uniforms.shape != (n, b):
                raise ValueError(f"decode generate: uniforms must be [{n}, {b}], got {tuple(uniforms.shape)}")
            uniforms = uniforms.to(torch.float64).contiguous()
            up = ctypes.cast(uniforms.data_ptr(), ctypes.POINTER(ctypes.c_double))
        stop = torch.tensor(list(stop_token_ids) or [0], dtype=torch.int64)
        tokens, logprobs = torch.zeros(b, n, dtype=torch.int64), torch.zeros(b, n)
        counts, live, step_tok = torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.uint8), torch.zeros(
            2 * b, dtype=torch.int64)
        i64 = ctypes.POINTER(ctypes.c_int64)
        rc = self._lib.mf_generate(
            ctypes.byref(self._model), self._logits_ptr, up, temperature, ctypes.cast(stop.data_ptr(), i64),
            len(stop_token_ids), first_col, ctypes.cast(tokens.data_ptr(), i64), _ptr(logprobs),
            ctypes.cast(counts.data_ptr(), i64), self._work_ptr,
            ctypes.cast(live.data_ptr(), ctypes.POINTER(ctypes.c_uint8)), ctypes.cast(step_tok.data_ptr(), i64))
        if rc == 2:
            raise ValueError(f"decode generate: a token id is outside the vocabulary [0, {v})")
        if rc != 0:
            raise ValueError(f"decode generate: cache column {first_col} + {n} steps is outside the plan "
                             f"({self._model.max_len} columns)")
        return tokens, logprobs, counts


def prefill(params: dict[str, Any], cfg: Any, tokens: torch.Tensor, positions: torch.Tensor,
            cache: list[tuple[torch.Tensor, torch.Tensor]], start: int, head: bool = True) -> torch.Tensor | None:
    """model.last_logits on the kernel for a dense causal block: tokens [B, T] (no padding) at positions
    [B, T] into cache columns start..start+T, each attending every column before it. Logits [B, V] of the
    last column (None with head=False).

    The block runs in pieces of at most mf_blocked_rows // B tokens a row, each on the cache the ones before
    it wrote: a pass streams the weights once for all its rows, in the kernel's own GEMM (MKL ran 24-44 rows
    at ~60 GFLOP/s here). The pieces are a function of (B, T) alone, so a prompt prefills the same way at
    every call. Its reductions are the kernel's, so the logits equal model.last_logits' to float32 rounding.
    """
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is unavailable: {why}")
    if tokens.dim() != 2 or 0 in tokens.shape or positions.shape != tokens.shape:
        raise ValueError(f"decode prefill: tokens must be [B, T] with B, T >= 1 and positions the same shape, got "
                         f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
    b, t = tokens.shape
    piece = min(t, max(1, (small_rows(lib) or int(lib.mf_blocked_rows())) // b))  # rows the kernel's GEMM takes
    width = cache[0][0].shape[2]
    valid = torch.zeros(b, width, dtype=torch.uint8)
    valid[:, : start + t] = 1
    cos, sin = (x[:, 0] for x in rope_tables(positions, cfg.dim_head, cfg.rope_theta))
    # two plans at most (the full pieces', the remainder's), each over the whole rope table: a plan build is a
    # step of _derived's clock, so a long prompt does not push another model's weight copies out
    sizes = {piece, t % piece or piece}
    plans = {n: DecodePlan(params, cfg, cache, valid, cos, sin, block=n, pack=False) for n in sizes}
    out = None
    for p0 in range(0, t, piece):
        n = min(piece, t - p0)
        last = head and p0 + n == t
        got = plans[n].block_step(tokens[:, p0 : p0 + n], torch.full((b,), p0, dtype=torch.int64), start + p0,
                                  head=last, last_only=True)
        out = got.clone() if last else None
    return out

