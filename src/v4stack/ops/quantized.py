"""Block-scaled weight formats of the released V4 checkpoints, and their CPU linear.

Two formats, as stored:

- ``fp8``: float8 e4m3 values ``[N, K]`` with one scale per 128 x 128 block,
  ``scale [ceil(N/128), ceil(K/128)]``; value = ``q[i, j] * scale[i // 128, j // 128]``.
- ``fp4``: float4 e2m1 values packed two per byte, ``[N, K/2]`` int8 (the low nibble holds the even
  column), with one scale per 1 x 32 block, ``scale [N, K/32]``; value = ``e2m1(nibble) * scale``.

Scales are float8 e8m0 (a power of two, ``2^(byte - 127)``) in the released files; float32
scales load too. With e8m0 scales every dequantised value is exactly representable in fp32
(e4m3 carries 4 significant bits, e2m1 2, and a power-of-two product adds none), so the
dequantised fp32 weight is the stored weight, bit for bit.

``ops.linear`` accepts a ``QuantizedWeight`` in place of a dense weight; on the CPU it
dequantises once per (dtype, device) and runs the dense GEMM of the current ops mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32
# e2m1 code -> value (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# midpoints between neighbouring magnitudes, and whether a tie rounds down (to the even code)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_DOWN = (True, False, True, False, True, False, True)
FORMATS = ("fp8", "fp4")
_CONST: dict = {}


def _const(values: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once: a copy from the host is not allowed while a
    CUDA graph is being captured, and the rounding runs inside captured decode steps."""
    key = (values, dtype, str(device))
    t = _CONST.get(key)
    if t is None:
        t = _CONST[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


class FormatError(ValueError):
    """A quantised tensor or its scale does not have the shape or dtype its format requires."""


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 (e8m0 bytes decode to exact powers of two)."""
    if scale.dtype == torch.float8_e8m0fnu:
        e = scale.view(torch.uint8).to(torch.int32)
        return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return scale.to(torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly (frexp, no log rounding)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value (ties to even), saturating at +-448; same dtype out."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15) of each value (ties to even, saturating at +-6), int64."""
    a = x.abs().clamp(max=FP4_MAX)
    mids = _const(_E2M1_MIDS, a.dtype, a.device)
    mag = torch.bucketize(a, mids, right=True)  # a tie lands above its midpoint ...
    for i, down in enumerate(_E2M1_TIE_DOWN):
        if down:  # ... and goes back down where the lower neighbour has the even code
            mag = torch.where(a == mids[i], torch.full_like(mag, i), mag)
    return torch.where(torch.signbit(x), mag + 8, mag)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to even), saturating at +-6; same dtype out."""
    lut = _const(E2M1_VALUES, x.dtype, x.device)
    return lut[e2m1_codes(x)]


# ---- activation rounding (V4's quantisation-aware activations; model/quant.py installs it) ----------


def _blockwise(x: torch.Tensor, block: int, fn) -> torch.Tensor:
    """Apply ``fn`` to each ``block``-wide slice of the last dim (the last may be narrower)."""
    D = x.shape[-1]
    if D <= block:
        return fn(x)
    return torch.cat([fn(x[..., i : i + block]) for i in range(0, D, block)], dim=-1)


def fp8_round(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Quantise-dequantise to e4m3 with a power-of-two scale per ``block`` along the last dim."""

    def one(b):
        scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_MAX)
        return round_e4m3(b / scale) * scale

    return _blockwise(x, block, one)


def fp4_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantise-dequantise to e2m1 with a power-of-two scale per ``block`` along the last dim."""

    def one(b):
        scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126) / FP4_MAX)
        return round_e2m1(b / scale) * scale

    return _blockwise(x, block, one)


# ---- weight encode / decode ------------------------------------------------------------------


def _blocks2d(shape: tuple[int, int], block: int) -> tuple[int, int]:
    return (-(-shape[0] // block), -(-shape[1] // block))


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK, e8m0: bool = True):
    """Dense ``[N, K]`` -> (e4m3 ``[N, K]``, scale ``[ceil(N/b), ceil(K/b)]``), scale = amax/448
    per block (rounded up to a power of two and stored as e8m0 when ``e8m0``)."""
    N, K = w.shape
    bn, bk = _blocks2d((N, K), block)
    wf = torch.nn.functional.pad(w.float(), (0, bk * block - K, 0, bn * block - N))
    blk = wf.view(bn, block, bk, block)
    amax = blk.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if e8m0:
        scale = pow2_ceil(scale)
    q = (blk / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(bn * block, bk * block)[:N, :K].contiguous()
    return q, (scale.to(torch.float8_e8m0fnu) if e8m0 else scale)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    N, K = q.shape
    s = scale_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]
    return q.to(torch.float32) * s


def quantize_fp4(w: torch.Tensor, block: int = FP4_BLOCK):
    """Dense ``[N, K]`` -> (packed int8 ``[N, K/2]``, e8m0 scale ``[N, K/block]``)."""
    N, K = w.shape
    if K % block or block % 2:
        raise FormatError(f"fp4 needs in_features ({K}) divisible by the block ({block})")
    blk = w.float().view(N, K // block, block)
    amax = blk.abs().amax(-1).clamp(min=FP4_MAX * 2.0 ** -126)
    scale = pow2_ceil(amax / FP4_MAX)
    codes = e2m1_codes(blk / scale.unsqueeze(-1)).view(N, K).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed.contiguous(), scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, half = packed.shape
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).view(N, 2 * half)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    s = scale_to_float(scale)
    block = 2 * half // s.shape[1]
    return lut[codes] * s.repeat_interleave(block, 1)


def check_format(fmt: str, data: torch.Tensor, scale: torch.Tensor | None, name: str,
                 shape: tuple[int, int] | None = None) -> tuple[int, int]:
    """Validate a stored (data, scale) pair; returns the dense ``[N, K]`` shape. Errors name
    ``name``."""
    if scale is None:
        raise FormatError(f"tensor '{name}' is {fmt} but its scale '{_scale_name(name)}' is missing")
    if data.dim() != 2 or scale.dim() != 2:
        raise FormatError(f"tensor '{name}' and its scale must be 2-D, got {tuple(data.shape)} and {tuple(scale.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise FormatError(f"scale of '{name}' has dtype {scale.dtype}; expected float8_e8m0fnu or float32")
    if fmt == "fp8":
        if data.dtype != torch.float8_e4m3fn:
            raise FormatError(f"tensor '{name}' is fp8 but has dtype {data.dtype}, expected float8_e4m3fn")
        N, K = data.shape
        want = _blocks2d((N, K), FP8_BLOCK)
    elif fmt == "fp4":
        if data.dtype not in (torch.int8, torch.uint8):
            raise FormatError(f"tensor '{name}' is fp4 (two values per byte) but has dtype {data.dtype}, expected int8")
        N, K = data.shape[0], 2 * data.shape[1]
        want = (N, K // FP4_BLOCK)
        if K % FP4_BLOCK:
            raise FormatError(f"tensor '{name}' has {K} fp4 columns, not a multiple of the {FP4_BLOCK}-wide block")
    else:
        raise FormatError(f"tensor '{name}': unknown weight format {fmt!r}; known: {FORMATS}")
    if tuple(scale.shape) != want:
        raise FormatError(f"scale of '{name}' has shape {tuple(scale.shape)}; a {fmt} weight of shape "
                          f"[{N}, {K}] needs block scales of shape {list(want)}")
    if shape is not None and (N, K) != tuple(shape):
        raise FormatError(f"tensor '{name}' holds a [{N}, {K}] weight, expected {list(shape)}")
    return N, K


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


@dataclass(eq=False)
class QuantizedWeight:
    """A linear weight in a stored block-scaled format; ``shape`` is the dense ``[N, K]``."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    _dense: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.shape = torch.Size(check_format(self.fmt, self.data, self.scale, f"<{self.fmt} weight>"))

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight (exact for e8m0 scales)."""
        if self.fmt == "fp8":
            return dequantize_fp8(self.data, self.scale)
        return dequantize_fp4(self.data, self.scale)

    def dense(self, dtype: torch.dtype, device) -> torch.Tensor:
        """Dequantised weight in ``dtype`` on ``device``, cached (the CPU path's one copy)."""
        key = (dtype, str(device))
        if key not in self._dense:
            self._dense.clear()
            self._dense[key] = self.dequantize().to(device=device, dtype=dtype)
        return self._dense[key]

    def rows(self, lo: int, hi: int) -> "QuantizedWeight":
        """Output rows ``[lo, hi)`` as a weight of the same format (bounds on scale-block edges)."""
        br = FP8_BLOCK if self.fmt == "fp8" else 1
        if lo % br or (hi % br and hi != self.shape[0]):
            raise FormatError(f"rows [{lo}, {hi}) of a {self.fmt} weight must start and end on {br}-row scale blocks")
        return QuantizedWeight(self.fmt, self.data[lo:hi], self.scale[lo // br : -(-hi // br)])

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.fmt, self.data.to(device), self.scale.to(device))

    @property
    def device(self):
        return self.data.device
