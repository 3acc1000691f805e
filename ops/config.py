"""Which implementation each op uses: one frozen config, passed explicitly from the caller to every op.

    mode="reference"  plain torch (matmul, SDPA): fast, but a row's result depends on its batch.
    mode="invariant"  batch-invariant: a row's result is a function of that row's inputs alone
                      (not of how many rows share the call, padding, packing, or KV cache vs full
                      sequence), so the rollout engine and the trainer compute bitwise equal numbers.

Backends choose the kernels: attention_backend "torch" (SDPA, or the blocked invariant kernel),
"flash_attn" (flash_attn_varlen_func), "flash_attn_3" (flash_attn_interface); gemm_backend
"torch" or "deep_gemm" (FP8 block-scaled GEMM). GPU backends are imported through third_party.
decode_backend, for generate's one-token steps: "torch" (model.forward), "cpu_kernel" (the whole step
as one C call, ops.decode_cpu), or "auto" (cpu_kernel where it can run, else torch). Neither C path
is batch-invariant, so mode="invariant" always decodes with torch.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

MODES = ("reference", "invariant")
ATTENTION_BACKENDS = ("torch", "flash_attn", "flash_attn_3")
GEMM_BACKENDS = ("torch", "deep_gemm")
DECODE_BACKENDS = ("torch", "cpu_kernel", "auto")


@dataclasses.dataclass(frozen=True)
class OpsConfig:
    mode: str = "reference"
    attention_backend: str = "torch"
    gemm_backend: str = "torch"
    compile: bool = False  # torch.compile the model forward
    decode_backend: str = "torch"  # generate's decode steps: see the module docstring
    tile_rows: int = 64  # invariant linear: every GEMM call has exactly this many rows
    kv_block: int = 1  # invariant attention: keys reduced in blocks of this many (1 = one at a time)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ops mode {self.mode!r} is not one of {MODES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of {ATTENTION_BACKENDS}")
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend {self.gemm_backend!r} is not one of {GEMM_BACKENDS}")
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend {self.decode_backend!r} is not one of {DECODE_BACKENDS}")
        if self.decode_backend == "cpu_kernel" and (self.invariant or self.compile):
            raise ValueError("decode_backend='cpu_kernel' (--decode_backend=cpu_kernel) cannot be combined with "
                             f"mode={self.mode!r}, compile={self.compile}: the C kernel is neither batch-invariant "
                             "nor compiled; use --decode_backend=auto or torch")
        if self.compile and self.invariant:
            raise ValueError("compile=True cannot be combined with mode='invariant' (--compile with "
                             "--true_on_policy): inductor re-fuses the reductions whose shapes and order the "
                             "invariant kernels fix, so the engine and trainer would no longer agree bit for bit")
        if self.tile_rows < 1 or self.kv_block < 1:
            raise ValueError(f"tile_rows ({self.tile_rows}) and kv_block ({self.kv_block}) must be >= 1")

    @property
    def invariant(self) -> bool:
        return self.mode == "invariant"


REFERENCE = OpsConfig()
INVARIANT = OpsConfig(mode="invariant")


def use_deterministic_algorithms(mode: bool, compile: bool = False) -> None:
    """torch.use_deterministic_algorithms(mode), without importing inductor unless compile is on.

    torch's function also sets torch._inductor.config.deterministic, and importing that module costs
    ~1.3 s of every process start on these CPUs (most of a tiny run's start-up). Inductor's flag
    matters only where torch.compile runs, so without compile only the eager flag is set."""
    if compile or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=False)


def require_backends(cfg: OpsConfig) -> None:
    """Fail early, naming the missing package, when a chosen backend cannot run here."""
    import third_party

    needs = {"flash_attn": "flash_attn", "flash_attn_3": "flash_attn_3"}
    if cfg.attention_backend in needs:
        third_party.require(needs[cfg.attention_backend], f"--attention_backend={cfg.attention_backend}")
    if cfg.gemm_backend == "deep_gemm":
        third_party.require("deep_gemm", "--gemm_backend=deep_gemm")
    if cfg.decode_backend == "cpu_kernel":
        from ops import decode_cpu

        if why := decode_cpu.status():
            raise third_party.MissingPackageError(f"--decode_backend=cpu_kernel cannot run here: {why}")
    if (cfg.attention_backend != "torch" or cfg.gemm_backend != "torch") and not third_party.cuda_available():
        raise third_party.MissingPackageError(
            f"--attention_backend={cfg.attention_backend} --gemm_backend={cfg.gemm_backend} need a CUDA device "
            "(torch.cuda.is_available() is False); use the torch backends on CPU"
        )
