"""Weights in safetensors under the official V4 tensor names.

A saved model directory holds ``config.json`` and one or more ``*.safetensors`` files (written
atomically); each tensor's CRC32 is stored in its file's metadata and checked on load, so a
flipped byte is reported by tensor name. Dense dtypes (fp32, bf16, fp16, fp64) load as they are.
Block-scaled weights load as stored: ``X.weight`` in FP8 e4m3 (or FP4 e2m1 packed two per byte)
next to its ``X.scale``; the layer keeps the ``QuantizedWeight`` (``ops.linear`` dispatches on it)
and a dequantised dense copy for code that reads the weight directly. A quantised checkpoint
turns the official activation rounding on (``model/quant.py``) unless its config says otherwise.
Files are memory-mapped and read one tensor at a time.
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
from v4stack.model.linear import Linear
from v4stack.model.model import V4Model
from v4stack.ops.quantized import FormatError, QuantizedWeight, check_format

WEIGHTS_FILE = "model.safetensors"
_CRC_PREFIX = "crc32:"
_QUANTISED = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2") if hasattr(torch, n)}
QUANT_KEY = "quantization"  # config.json record of a quantised checkpoint


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


def _quantised_pairs(model: V4Model, tensors: dict[str, torch.Tensor], expected, problems: list[str]):
    """Find ``X.weight`` + ``X.scale`` pairs; returns {weight name: QuantizedWeight}."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".weight"):
            continue
        sname = name[: -len(".weight")] + ".scale"
        scale = tensors.get(sname)
        if t.dtype not in _QUANTISED and not (scale is not None and t.dtype in (torch.int8, torch.uint8)):
            continue
        fmt = "fp8" if t.dtype == torch.float8_e4m3fn else "fp4" if t.dtype in (torch.int8, torch.uint8) else None
        if fmt is None:
            problems.append(f"tensor '{name}' is quantised ({t.dtype}); only float8_e4m3fn and packed fp4 load")
            continue
        if scale is None:
            problems.append(f"tensor '{name}' is quantised ({t.dtype}) but its scale '{sname}' is missing")
            continue
        if name not in expected:
            continue  # reported as unexpected
        try:
            mod = model.get_submodule(name[: -len(".weight")])
        except AttributeError:
            mod = None
        if not isinstance(mod, Linear):
            problems.append(f"tensor '{name}' is quantised but '{name[:-7]}' is not a linear layer")
            continue
        try:
            check_format(fmt, t, scale, name, tuple(expected[name].shape))
        except FormatError as e:
            problems.append(str(e))
            continue
        out[name] = QuantizedWeight(fmt, t, scale)
    return out


def load_state(model: V4Model, tensors: dict[str, torch.Tensor]) -> int:
    """Copy ``tensors`` into ``model``; every mismatch is named. Returns the number of
    block-scaled weights loaded."""
    expected = model.state_dict()
    problems: list[str] = []
    quant = _quantised_pairs(model, tensors, expected, problems)
    scales = {n[: -len(".weight")] + ".scale" for n in quant}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - scales
                   - {n for n in tensors if n.endswith(".scale") and n[:-6] + ".weight" in tensors})
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
    for name in sorted(set(expected) & set(tensors)):
        t, e = tensors[name], expected[name]
        if name in quant or t.dtype in _QUANTISED or (t.dtype in (torch.int8, torch.uint8) and e.is_floating_point()):
            continue
        if tuple(t.shape) != tuple(e.shape):
            problems.append(f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(e.shape)}")
        elif t.is_floating_point() != e.is_floating_point():
            problems.append(f"tensor '{name}' has dtype {t.dtype}, expected a {e.dtype}-compatible dtype")
    if problems:
        raise WeightsError("; ".join(problems))
    with torch.no_grad():
        for name, p in model.state_dict(keep_vars=True).items():
            if name in quant:
                qw = quant[name]
                p.data = qw.dequantize().to(p.device)
                qw._dense[(p.dtype, str(p.device))] = p.data  # the CPU linear reuses this copy
                model.get_submodule(name[: -len(".weight")]).qweight = qw
                continue
            t = tensors[name]
            p.data = t.to(p.device,
                          dtype=t.dtype if p.is_floating_point() else p.dtype).clone()
    return len(quant)


def load_model(path: str | os.PathLike, dtype: torch.dtype | None = None, verify: bool = True,
               act_rounding: bool | None = None) -> V4Model:
    """Build the model from ``path/config.json`` and load its weights (kept in their saved dtypes
    unless ``dtype`` is given; a quantised checkpoint gives an fp32 model by default).

    ``act_rounding``: the official activation rounding; default on for quantised checkpoints
    (unless the config's ``quantization.act_rounding`` is false), off otherwise.
    """
    p = Path(path)
    if (p / INDEX_FILE).exists() and not _is_project(p):
        raise WeightsError(f"{p} is in the released layout; run `v4stack convert {p} <dir>` first")
    cfg = ModelConfig.load(p)
    model = V4Model(cfg, seed=None)
    n_quant = load_state(model, read_tensors(p, verify=verify))
    if n_quant and dtype is None:
        dtype = torch.float32
    if dtype is not None:
        model.cast(dtype)
    if act_rounding is None:
        rec = _raw_config(p).get(QUANT_KEY) or {}
        act_rounding = bool(n_quant) and rec.get("act_rounding", True)
    if act_rounding:
        from v4stack.model.quant import set_act_rounding

        set_act_rounding(model, True)
    return model


INDEX_FILE = "model.safetensors.index.json"


def _raw_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _is_project(path: Path) -> bool:
    return _raw_config(path).get("producer") == "v4stack"


def describe(path: str | os.PathLike) -> dict:
    """Names, shapes and dtypes of a checkpoint, without loading tensor data."""
    out = {}
    for f in _files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                out[name] = {"shape": sl.get_shape(), "dtype": sl.get_dtype(), "file": f.name}
    return json.loads(json.dumps(out))
