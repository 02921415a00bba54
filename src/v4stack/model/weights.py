"""Weights in safetensors under the official V4 tensor names.

A saved model directory holds ``config.json`` and ``model.safetensors`` (written atomically);
each tensor's CRC32 is stored in the file's metadata and checked on load, so a flipped byte is
reported by tensor name. Sharded directories (``*.safetensors``) load too. Dense dtypes
(fp32, bf16, fp16, fp64) load today; FP8 / FP4 quantised tensors are refused with a clear error.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from v4stack.atomic import atomic_write
from v4stack.config import ModelConfig
from v4stack.model.model import V4Model

WEIGHTS_FILE = "model.safetensors"
_CRC_PREFIX = "crc32:"
_QUANTISED = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2") if hasattr(torch, n)}


class WeightsError(ValueError):
    """A checkpoint does not match the model: missing, extra, mis-shaped or corrupt tensors."""


def _crc(t: torch.Tensor) -> str:
    b = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return f"{zlib.crc32(b) & 0xFFFFFFFF:08x}"


def save_model(model: V4Model, path: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into directory ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # clone: stacked expert weights are views of one tensor, and the file needs unshared storage
    tensors = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "producer": "v4stack"}
    meta.update({_CRC_PREFIX + k: _crc(v) for k, v in tensors.items()})
    atomic_write(out / WEIGHTS_FILE, st_save(tensors, metadata=meta))
    model.cfg.save(out / "config.json")
    return out


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {path}")
    return files


def read_tensors(path: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of a file or directory, CRC-checked where the file carries checksums."""
    out: dict[str, torch.Tensor] = {}
    for f in _files(Path(path)):
        try:
            with safe_open(str(f), framework="pt") as h:
                meta = h.metadata() or {}
                for name in h.keys():
                    if name in out:
                        raise WeightsError(f"tensor '{name}' appears in more than one file ({f.name})")
                    t = h.get_tensor(name)
                    want = meta.get(_CRC_PREFIX + name)
                    if verify and want is not None and _crc(t) != want:
                        raise WeightsError(f"tensor '{name}' in {f.name} is corrupt (checksum mismatch)")
                    out[name] = t
        except SafetensorError as e:
            raise WeightsError(f"{f}: not a readable safetensors file ({e})") from e
    return out


def load_state(model: V4Model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``; every mismatch is named."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
    for name in sorted(set(expected) & set(tensors)):
        t, e = tensors[name], expected[name]
        if t.dtype in _QUANTISED:
            problems.append(f"tensor '{name}' is quantised ({t.dtype}); only dense fp32/bf16/fp16/fp64 load today")
        elif tuple(t.shape) != tuple(e.shape):
            problems.append(f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(e.shape)}")
        elif t.is_floating_point() != e.is_floating_point():
            problems.append(f"tensor '{name}' has dtype {t.dtype}, expected a {e.dtype}-compatible dtype")
    if problems:
        raise WeightsError("; ".join(problems))
    with torch.no_grad():
        for name, p in model.state_dict(keep_vars=True).items():
            t = tensors[name]
            p.data = t.to(p.device,
                          dtype=t.dtype if p.is_floating_point() else p.dtype).clone()


def load_model(path: str | os.PathLike, dtype: torch.dtype | None = None, verify: bool = True) -> V4Model:
    """Build the model from ``path/config.json`` and load its weights (kept in their saved dtypes
    unless ``dtype`` is given)."""
    p = Path(path)
    cfg = ModelConfig.load(p)
    model = V4Model(cfg, seed=None)
    load_state(model, read_tensors(p, verify=verify))
    if dtype is not None:
        model.cast(dtype)
    return model


def describe(path: str | os.PathLike) -> dict:
    """Names, shapes and dtypes of a checkpoint, without loading tensor data."""
    out = {}
    for f in _files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                out[name] = {"shape": sl.get_shape(), "dtype": sl.get_dtype(), "file": f.name}
    return json.loads(json.dumps(out))
