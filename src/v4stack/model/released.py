"""The released checkpoint layout, and conversion to and from the project's layout.

Released layout (a directory, as published):
  ``config.json`` (the official fields plus ``quantization_config`` / ``expert_dtype``),
  ``model.safetensors.index.json`` (``weight_map``: tensor -> shard), and shards
  ``model-0000i-of-0000n.safetensors``. Tensor names are the official inference names (the
  project's own). Dense projections are FP8 e4m3 ``X.weight`` with ``X.scale`` (e8m0, one per
  128 x 128 block); routed experts are FP4 e2m1 packed two per byte (int8 ``[N, K/2]``) with
  ``X.scale`` (e8m0, one per 1 x 32 block); embedding, head, norms, gate, compressors and indexer
  are BF16; mHC parameters, sinks, ``ape`` and the gate bias FP32; ``tid2eid`` integer.

Project layout: ``config.json`` (``ModelConfig`` fields, ``producer: v4stack`` and a
``quantization`` record), shards with a CRC32 per tensor in their metadata (same grouping as the
source), and ``source.json``, which keeps the released files' own parts that are not tensor data
(config and index text, each shard's header), so converting back writes the released files byte
for byte. Every check names the tensor: a weight without its scale, a scale of the wrong block
shape, a tensor cut short by a truncated shard, a name or shape the config does not expect.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from v4stack.atomic import atomic_write
from v4stack.config import ConfigError, ModelConfig
from v4stack.model.init import is_fp32_param
from v4stack.model.model import V4Model
from v4stack.model.quant import quantize_weight, released_format
from v4stack.model.weights import _CRC_PREFIX, INDEX_FILE, QUANT_KEY, WeightsError, _crc, read_tensors
from v4stack.ops.quantized import FormatError, check_format

SOURCE_FILE = "source.json"
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
PROJECT_QUANT = {"weights": "fp8 e4m3, e8m0 scale per 128x128 block",
                 "experts": "fp4 e2m1 packed 2 per byte, e8m0 scale per 1x32 block", "act_rounding": True}
_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
              "U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# ---- headers ---------------------------------------------------------------------------------


def read_header(path: Path) -> tuple[bytes, dict]:
    """The raw header bytes and parsed header of a safetensors file; a tensor whose bytes run
    past the end of the file (a truncated shard) is named."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path.name}: truncated before its header")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    if len(raw) < n:
        raise WeightsError(f"{path.name}: truncated inside its header ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path.name}: header is not valid JSON ({e})") from e
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if end > data:
            raise WeightsError(f"tensor '{name}' in {path.name} is cut short: the shard is truncated "
                               f"({data} data bytes, the tensor ends at {end})")
    return raw, header


def _meta_tensor(info: dict, name: str) -> torch.Tensor:
    if info["dtype"] not in _ST_DTYPES:
        raise WeightsError(f"tensor '{name}' has unsupported dtype {info['dtype']}")
    return torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]], device="meta")


def check_tensors(cfg: ModelConfig, infos: dict[str, torch.Tensor]) -> None:
    """Names, shapes, formats and scales of a checkpoint (given as meta tensors) against ``cfg``."""
    with torch.device("meta"):
        expected = V4Model(cfg, seed=None).state_dict()
    problems = []
    scales = set()
    for name, t in infos.items():
        quant = t.dtype == torch.float8_e4m3fn or (t.dtype in (torch.int8, torch.uint8) and name in expected
                                                   and expected[name].is_floating_point())
        if not quant:
            continue
        sname = name[: -len(".weight")] + ".scale"
        scales.add(sname)
        try:
            check_format("fp8" if t.dtype == torch.float8_e4m3fn else "fp4", t, infos.get(sname), name,
                         tuple(expected[name].shape) if name in expected else None)
        except FormatError as e:
            problems.append(str(e))
    missing = sorted(set(expected) - set(infos))
    extra = sorted(set(infos) - set(expected) - scales)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}")
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:8])}")
    for name in sorted(set(expected) & set(infos)):
        t, e = infos[name], expected[name]
        if name[: -len(".weight")] + ".scale" in scales:
            continue
        if tuple(t.shape) != tuple(e.shape):
            problems.append(f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(e.shape)}")
    if problems:
        raise WeightsError("; ".join(problems))


# ---- released -> project ---------------------------------------------------------------------


def _released_parts(src: Path):
    """(config text, index text, weight_map, {shard: (raw header, header)}), all checked."""
    for f in ("config.json", INDEX_FILE):
        if not (src / f).exists():
            raise WeightsError(f"{src} is not a released checkpoint: no {f}")
    config_text = (src / "config.json").read_text()
    index_text = (src / INDEX_FILE).read_text()
    try:
        weight_map = json.loads(index_text)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise WeightsError(f"{src / INDEX_FILE}: no readable weight_map ({e})") from e
    headers = {}
    for shard in sorted(set(weight_map.values())):
        if not (src / shard).exists():
            raise WeightsError(f"shard {shard} named by the index (e.g. for tensor "
                               f"'{next(n for n, s in weight_map.items() if s == shard)}') is missing")
        headers[shard] = read_header(src / shard)
    for name, shard in weight_map.items():
        if name not in headers[shard][1]:
            raise WeightsError(f"tensor '{name}' is indexed in {shard} but that shard does not hold it")
    for shard, (_, h) in headers.items():
        for name in h:
            if name != "__metadata__" and weight_map.get(name) != shard:
                raise WeightsError(f"tensor '{name}' in {shard} is not in the index's weight_map")
    return config_text, index_text, weight_map, headers


def _fresh_dir(dst: Path) -> Path:
    if dst.exists():
        raise WeightsError(f"destination {dst} already exists; choose a new directory")
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, dst: Path) -> Path:
    os.replace(tmp, dst)
    return dst


def to_project(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert a released checkpoint directory into the project's layout (a new directory)."""
    src, dst = Path(src), Path(dst)
    config_text, index_text, weight_map, headers = _released_parts(src)
    try:
        cfg = ModelConfig.from_dict(json.loads(config_text))
    except (ConfigError, json.JSONDecodeError) as e:
        raise WeightsError(f"{src / 'config.json'}: {e}") from e
    infos = {n: _meta_tensor(h[n], n) for _, h in headers.values() for n in h if n != "__metadata__"}
    check_tensors(cfg, infos)
    tmp = _fresh_dir(dst)
    try:
        shards = sorted(headers)
        record = {"config": config_text, "index": index_text, "shards": []}
        for i, shard in enumerate(shards):
            raw, header = headers[shard]
            with safe_open(str(src / shard), framework="pt") as h:
                tensors = {n: h.get_tensor(n) for n in header if n != "__metadata__"}
            pname = shard_name(i, len(shards))
            meta = {"format": "pt", "producer": "v4stack"}
            meta.update({_CRC_PREFIX + k: _crc(v) for k, v in tensors.items()})
            atomic_write(tmp / pname, st_save(tensors, metadata=meta))
            record["shards"].append({"file": shard, "project_file": pname, "header": raw.decode("utf-8")})
            del tensors
        atomic_write(tmp / SOURCE_FILE, (json.dumps(record, indent=1) + "\n").encode())
        _write_project_config(tmp, cfg, quantised=any(t.dtype == torch.float8_e4m3fn for t in infos.values()))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, dst)


def _write_project_config(path: Path, cfg: ModelConfig, quantised: bool) -> None:
    d = cfg.to_dict()
    d["producer"] = "v4stack"
    if quantised:
        d[QUANT_KEY] = dict(PROJECT_QUANT)
    atomic_write(path / "config.json", (json.dumps(d, indent=2) + "\n").encode())


# ---- project -> released ---------------------------------------------------------------------


def to_released(src: str | os.PathLike, dst: str | os.PathLike, shards: int = 1) -> Path:
    """Convert a project checkpoint into the released layout. A checkpoint that came from a
    released one is written back byte for byte (its ``source.json``); any other is quantised
    into the released formats and split into ``shards`` files."""
    src, dst = Path(src), Path(dst)
    if not (src / SOURCE_FILE).exists():
        tensors = read_tensors(src)
        cfg = ModelConfig.load(src)
        tmp = _fresh_dir(dst)
        try:
            write_released(cfg, tensors, tmp, shards)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return _finish(tmp, dst)
    record = json.loads((src / SOURCE_FILE).read_text())
    tmp = _fresh_dir(dst)
    try:
        for sh in record["shards"]:
            tensors = read_tensors(src / sh["project_file"])
            raw = sh["header"].encode("utf-8")
            header = json.loads(raw)
            parts = sorted((info["data_offsets"], n) for n, info in header.items() if n != "__metadata__")
            blob = [struct.pack("<Q", len(raw)), raw]
            for (start, end), n in parts:
                t = tensors.get(n)
                if t is None:
                    raise WeightsError(f"tensor '{n}' of {sh['file']} is missing from {sh['project_file']}")
                b = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                if (list(t.shape) != header[n]["shape"] or _ST_DTYPES.get(header[n]["dtype"]) != t.dtype
                        or len(b) != end - start):
                    raise WeightsError(f"tensor '{n}' no longer matches the released header of {sh['file']}")
                blob.append(b)
            atomic_write(tmp / sh["file"], b"".join(blob))
        atomic_write(tmp / "config.json", record["config"].encode())
        atomic_write(tmp / INDEX_FILE, record["index"].encode())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, dst)


def released_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense project tensors in the released formats: FP8 / FP4 weights with scales, BF16 for
    the rest of the floats except V4's FP32 parameters, integers as they are."""
    out = {}
    for name, t in tensors.items():
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            out[name] = t
            continue
        qw = quantize_weight(name, t)
        if qw is not None:
            out[name], out[name[: -len(".weight")] + ".scale"] = qw.data, qw.scale
        else:
            out[name] = t.to(torch.float32 if is_fp32_param(name) else torch.bfloat16)
    return out


def _released_names(name: str, t: torch.Tensor) -> list[str]:
    """The released tensor names ``released_tensors`` makes of project tensor ``name``."""
    if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu) \
            and released_format(name) is not None:
        return [name, name[: -len(".weight")] + ".scale"]
    return [name]


def write_released(cfg: ModelConfig, tensors, path: Path, shards: int = 1) -> Path:
    """Write ``tensors`` (a mapping, dense or already in the released formats) as a released
    checkpoint, one shard at a time: only the shard being written is held converted (the source
    tensors of a checkpoint on disk are memory-mapped, ``read_tensors``)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    source = {r: n for n in tensors for r in _released_names(n, tensors[n])}
    names = sorted(source)
    per = -(-len(names) // shards)
    groups = [names[i : i + per] for i in range(0, len(names), per)]
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = shard_name(i, len(groups))
        conv = released_tensors({n: tensors[n] for n in sorted({source[r] for r in group})})
        part = {n: conv[n].contiguous() for n in group}
        del conv
        atomic_write(path / fname, st_save(part, metadata={"format": "pt"}))
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(path / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    d = cfg.to_dict()
    d["quantization_config"] = dict(QUANTIZATION_CONFIG)
    d["expert_dtype"] = "fp4"
    atomic_write(path / "config.json", (json.dumps(d, indent=2) + "\n").encode())
    return path


def export_released(model: V4Model, path: str | os.PathLike, shards: int = 1) -> Path:
    """Quantise ``model`` into a released-layout checkpoint (a new directory)."""
    dst = Path(path)
    tmp = _fresh_dir(dst)
    try:
        write_released(model.cfg, {k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp, shards)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, dst)


def detect_layout(path: str | os.PathLike) -> str:
    """``released`` or ``project``."""
    p = Path(path)
    if (p / INDEX_FILE).exists() and not (p / SOURCE_FILE).exists():
        try:
            producer = json.loads((p / "config.json").read_text()).get("producer")
        except (OSError, json.JSONDecodeError):
            producer = None
        if producer != "v4stack":
            return "released"
    return "project"
