"""The only place that imports optional accelerator packages; everyone else asks here."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# Feature name -> (module to import, pip package that provides it).
_PACKAGES = {
    "flash_attn": ("flash_attn", "flash-attn"),
    "flash_attn_3": ("flash_attn_interface", "flash-attn (FlashAttention 3, hopper build)"),
    "deep_gemm": ("deep_gemm", "deep-gemm"),
    "sglang": ("sglang", "sglang"),
}


class MissingPackageError(ImportError):
    """An optional accelerator package that a flag asked for is not installed."""


def available(name: str) -> bool:
    module, _ = _PACKAGES[name]
    return importlib.util.find_spec(module) is not None


def require(name: str, why: str) -> ModuleType:
    """Import an optional package, or fail with a message that names it and the flag that wanted it."""
    module, package = _PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackageError(
            f"{why} needs the package {package!r} (import {module!r} failed: {e}); "
            f"install it (pip install 'miles-fn[gpu]') or choose another backend"
        ) from e


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
