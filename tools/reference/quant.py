"""The quantized formats of docs/quantization.md, for the float64 reference.

Every step that the C engine does in float32 (src/kernels/shared/quant.h, kernels/cpu/matmul_quant.c)
is done here in numpy float32, op for op, so that codes and scales are bit-identical to C's for the
same f32 input: amax, s = max(amax / 448, 1 / (448 * 512)), inv = 1 / s, code = e4m3(x * inv).
What follows the codes (products, sums, dequantized values) is float64: exact products, and sums that
are exact too at the tiny models' widths (each E4M3 x E4M3 product has at most 8 significant bits).

  f32_to_e4m3(x)         §1 rounding (nearest, ties to even, saturating at +-448; NaN -> 0x7f)
  E4M3_VALUES[code]      the value of every code (float64; NaN for 0x7f / 0xff)
  ptpc_quantize_rows(x)  §3: codes [N, K] and f32 scales [N] of each row of x
  QMat                   a ptpc_fp8 weight (codes, row scales) and the §3 product with it
  fp8_kv_row(c, kR)      §4: the stored-then-read values of MLA latent rows
  dequant_mxfp4(...)     §2: compressed-tensors MXFP4 (refuses E8M0 byte 255)
"""
from __future__ import annotations

import numpy as np
import torch

DT = torch.float64
F32 = np.float32
FP8_MAX = F32(448.0)
PTPC_MIN_SCALE = F32(1.0) / (F32(448.0) * F32(512.0))  # as C's 1.0f / (448.0f * 512.0f)
KV_TILE = 128  # §4: one f32 scale for each 128 latent values


def _e4m3_values() -> np.ndarray:
    """Value of each of the 256 codes, from the bit layout (quant.h ds_e4m3_to_f32)."""
    v = np.empty(256, dtype=np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v[b] = np.nan
        elif e == 0:
            v[b] = m * 2.0 ** -9
        else:
            v[b] = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        if s:
            v[b] = -v[b]
    return v


E4M3_VALUES = _e4m3_values()
E4M3_TORCH = torch.from_numpy(E4M3_VALUES)
_POS = np.unique(np.abs(E4M3_VALUES[np.isfinite(E4M3_VALUES)]))
E4M3_BOUNDARIES = (_POS[1:] + _POS[:-1]) / 2  # the rounding decision points between neighbouring codes


# --------------------------------------------------------------------------------------------------
# Rounding margins.  Each quantization is a discontinuous function: an engine whose activations differ
# from the reference's by a relative 1e-6 (f32 arithmetic) picks another code where the reference's value
# lies within 1e-6 of a rounding boundary, and that one code changes the token's output by ~1e-2 and,
# through the recurrent state and the caches, every later token's.  write_golden.py --min-margin draws
# input tokens whose margins all exceed a bound, so that an engine right up to f32 rounding meets the
# golden's tolerance.  MARGIN["min"] is the smallest margin seen since it was reset (when "on").
# --------------------------------------------------------------------------------------------------

MARGIN = {"on": False, "min": float("inf"), "where": ""}


def note_margin(d: float, where: str):
    if MARGIN["on"] and d < MARGIN["min"]:
        MARGIN["min"], MARGIN["where"] = float(d), where


def e4m3_margin(y: np.ndarray) -> float:
    """Smallest relative distance of the scaled values y (|x| * (1/s), in units of the scale, so the row's
    largest is 448) to an E4M3 rounding boundary; distances are taken relative to max(|y|, 1)."""
    y = np.abs(np.asarray(y, dtype=np.float64)).reshape(-1)
    if y.size == 0:
        return float("inf")
    j = np.clip(np.searchsorted(E4M3_BOUNDARIES, y), 1, len(E4M3_BOUNDARIES) - 1)
    d = np.minimum(np.abs(y - E4M3_BOUNDARIES[j - 1]), np.abs(y - E4M3_BOUNDARIES[j]))
    return float((d / np.maximum(y, 1.0)).min())


def bf16_margin(x: np.ndarray) -> float:
    """Smallest relative distance of f32 values to a BF16 rounding boundary (relative to max(|x|, 1e-2 of
    the row's largest))."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    if x.size == 0:
        return float("inf")
    floor = np.maximum(x.max(axis=-1, keepdims=True) * 1e-2, 1e-30)
    e = np.floor(np.log2(np.maximum(x, 1e-38)))
    u = np.exp2(e - 7)                               # BF16 spacing in [2^e, 2^(e+1))
    f = x / u
    d = np.abs(f - np.floor(f) - 0.5) * u
    return float((d / np.maximum(x, floor)).min())


def f32_to_e4m3(x) -> np.ndarray:
    """§1: float32 array -> uint8 codes, the same arithmetic as quant.h ds_f32_to_e4m3."""
    x = np.ascontiguousarray(np.asarray(x, dtype=F32))
    u = x.view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    a = np.abs(x)
    # normal range: keep 3 of 23 mantissa bits, round to nearest even on the 20 dropped bits
    au = a.view(np.uint32).astype(np.int64)
    au = au + 0x7FFFF + ((au >> 20) & 1)
    e, m = (au >> 23) - 120, (au >> 20) & 7
    over = (e > 15) | ((e == 15) & (m == 7))
    normal = np.where(over, 0x7E, (np.clip(e, 0, 15) << 3) | m)
    # below 2^-6: the subnormal grid of 2^-9, ties to even (rint); 8 is the smallest normal 0x08
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.rint(a * F32(512.0))
        sub = np.where(np.isnan(sub), 0, sub).astype(np.int64)
        code = np.where(a < F32(0.015625), sub, normal)
        code = np.where(a >= F32(464.0), 0x7E, code)  # 448 and everything that rounds past it
    code = code.astype(np.uint8) | sign
    return np.where(np.isnan(a), np.uint8(0x7F), code).astype(np.uint8)


def ptpc_scale(amax: np.ndarray) -> np.ndarray:
    """quant.h ds_ptpc_scale, elementwise in f32."""
    s = np.asarray(amax, dtype=F32) / FP8_MAX
    return np.where(s > PTPC_MIN_SCALE, s, PTPC_MIN_SCALE).astype(F32)


def ptpc_quantize_rows(x, label: str = "codes"):
    """§3 for each row of x [N, K] (float64 or float32; float64 is first rounded to f32, as C's
    activations are f32): returns (codes uint8 [N, K], scales f32 [N])."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to(torch.float32).numpy()
    x = np.asarray(x, dtype=F32)
    amax = np.abs(x).max(axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], dtype=F32)
    s = ptpc_scale(amax)
    inv = F32(1.0) / s
    if MARGIN["on"]:
        note_margin(e4m3_margin(x.astype(np.float64) * inv[..., None].astype(np.float64)), label)
    return f32_to_e4m3(x * inv[..., None]), s


class QMat:
    """A ptpc_fp8 weight [out, in]: E4M3 codes and one f32 scale a row, quantized at load from the
    checkpoint's values (BF16 / F16 / F32, exact in f32). `linear(x, qmat)` (model.py) runs the §3
    product: the input rows are quantized per token, and y = (sum_c xq wq * s_t) * s_r."""

    def __init__(self, name: str, w: torch.Tensor):
        if w.dim() != 2:
            raise ValueError(f"{name}: ptpc_fp8 quantizes matrices, got shape {tuple(w.shape)}")
        w32 = w.to(torch.float32)
        if not torch.equal(w32.to(w.dtype), w):
            raise ValueError(f"{name}: values are not exact in f32")
        self.name = name
        self.codes, self.scales = ptpc_quantize_rows(w32)     # uint8 [out, in], f32 [out]
        self.wq = E4M3_TORCH[torch.from_numpy(self.codes.astype(np.int64))]  # [out, in] code values
        self.s = torch.from_numpy(self.scales.astype(np.float64))           # [out]
        self.shape = tuple(w.shape)

    def dequant(self) -> torch.Tensor:
        """W as the codes hold it: wq[r][c] * s_r (float64, exact)."""
        return self.wq * self.s.view(-1, 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (float64) -> y [T, out]: (sum_c e4m3(x_t) e4m3(w_r) * s_t) * s_r, the sum in float64."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        codes, st = ptpc_quantize_rows(x2, "input of " + self.name)
        xq = E4M3_TORCH[torch.from_numpy(codes.astype(np.int64))]
        y = (xq @ self.wq.T) * torch.from_numpy(st.astype(np.float64)).view(-1, 1)
        y = y * self.s.view(1, -1)
        return y.reshape(*lead, self.shape[0])


# §3: never quantized whatever the list says (the lookup, the lm_head the DSpark draft shares, and
# kv_b_proj, whose transpose the absorbed attention also multiplies by).
NEVER = ("embed_tokens", "lm_head", "kv_b_proj")


def name_excluded(full_name: str, exclude: list) -> bool:
    """docs/quantization.md §3: excluded when the tensor name contains one of the fragments, or one of
    NEVER."""
    return any(f in full_name for f in NEVER) or any(f and f in full_name for f in exclude)


# The K3 recipe's list (§3 table). `self_attn.b_proj` is KDA's β projection only: a bare "b_proj" would
# also match q_b_proj, f_b_proj, g_b_proj and kv_b_proj (a substring test).
DEFAULT_EXCLUDE = ["embed_tokens", "lm_head", "conv1d", "block_sparse_moe.gate.weight", "self_attn.b_proj",
                   "kv_b_proj"]


# --------------------------------------------------------------------------------------------------
# §4 FP8 latent cache
# --------------------------------------------------------------------------------------------------


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """f64 -> f32 (C's kR is f32) -> BF16, round to nearest even both times; back to float64."""
    return x.to(torch.float32).to(torch.bfloat16).to(DT)


def fp8_kv_quantize_c(c: torch.Tensor):
    """c [T, R] (float64, rounded to f32 first) -> (codes uint8 [T, R], scales f32 [T, ceil(R/128)])."""
    T, R = c.shape
    nt = (R + KV_TILE - 1) // KV_TILE
    x = c.detach().to(torch.float32).numpy()
    codes = np.empty((T, R), dtype=np.uint8)
    scales = np.empty((T, nt), dtype=F32)
    for j in range(nt):
        cj, sj = ptpc_quantize_rows(x[:, j * KV_TILE: (j + 1) * KV_TILE], "latent c")
        codes[:, j * KV_TILE: (j + 1) * KV_TILE] = cj
        scales[:, j] = sj
    return codes, scales


def fp8_kv_dequant_c(codes: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    """The stored c values: code value x its tile's scale (float64, exact)."""
    v = E4M3_VALUES[codes] * np.repeat(scales.astype(np.float64), KV_TILE, axis=1)[:, : codes.shape[1]]
    return torch.from_numpy(v)


def fp8_kv_row(c: torch.Tensor, kR: torch.Tensor):
    """§4: what an attention reads back from a stored latent row [c | kR]."""
    codes, scales = fp8_kv_quantize_c(c)
    if MARGIN["on"]:
        note_margin(bf16_margin(kR.to(torch.float32).numpy()), "kR BF16")
    return fp8_kv_dequant_c(codes, scales), bf16_round(kR)


# --------------------------------------------------------------------------------------------------
# §2 MXFP4
# --------------------------------------------------------------------------------------------------

_FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=DT)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "MXFP4 tensor") -> torch.Tensor:
    """compressed-tensors MXFP4 (§2): packed U8 [out, in/2], element 2i in the low nibble, 2i+1 in the high
    nibble; E2M1 codes (bit 3 = sign); scale U8 [out, in/32], value 2^(byte-127) (byte 0 -> 2^-127;
    byte 255 is NaN and refused)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_packed / weight_scale must be U8")
    if packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0] \
            or scale.shape[1] * 32 != packed.shape[1] * 2:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} "
                         "are not [out, in/2] and [out, in/32]")
    if bool((scale == 255).any()):
        raise ValueError(f"{name}.weight_scale: E8M0 scale byte 255 (NaN)")
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).reshape(p.shape[0], -1)  # [out, in]
    mag = _FP4_E2M1[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    s = torch.pow(torch.tensor(2.0, dtype=DT), scale.to(DT) - 127.0)  # [out, in/32], exact in float64
    return val * s.repeat_interleave(32, dim=1)
