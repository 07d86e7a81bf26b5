#!/usr/bin/env python3
"""Self-checks of the quantized formats in the reference (quant.py, docs/quantization.md). CPU only.

  1. E4M3 rounding: quant.f32_to_e4m3 vs torch's float8_e4m3fn cast (in range: |x| <= 448) on every
     code value, every midpoint between neighbouring codes and the f32 values either side of it, and
     random f32 values; the out-of-range rules (saturation to 448, NaN -> 0x7f) against §1.
  2. The same codes, and the ptpc scales, against the C definitions: quant.h compiled with the
     activation quantizer of kernels/cpu/matmul_quant.c (needs a C compiler; skipped without one).
  3. ptpc_fp8: per-element error bound, fixed point on power-of-two scales, the §3 product against an
     element-by-element evaluation, scales only from the row's own amax.
  4. MXFP4 (§2): nibble order, E8M0 byte 0 = 2^-127, byte 254 = 2^127, byte 255 refused by name.
  5. Whole model, tiny-k3 / tiny-linear: prefill-then-decode and token-by-token equal the full forward
     with ptpc_fp8, with the FP8 latent cache, and with both; the FP8 cache holds E4M3 x scale values.

usage: check_quant.py [--k3 models/tiny-k3] [--linear models/tiny-linear] [--quick]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant as Q  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
RESULTS = []


def report(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)


def test_values():
    """f32 inputs covering every rounding decision of the E4M3 grid."""
    v = Q.E4M3_VALUES[np.isfinite(Q.E4M3_VALUES)]
    pos = np.unique(v[v >= 0])                                   # 0 .. 448, 127 values
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)         # exact in f32
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    rng = np.random.default_rng(0)
    rnd = np.exp2(rng.uniform(-14, np.log2(448.0), 400_000)).astype(np.float32)
    tiny = rng.uniform(0, 2.0 ** -6, 100_000).astype(np.float32)
    x = np.concatenate([pos.astype(np.float32), mids, near, rnd, tiny, [np.float32(2.0 ** -10)]])
    x = x[np.abs(x) <= 448]
    return np.concatenate([x, -x]).astype(np.float32)


def check_e4m3_torch():
    x = test_values()
    mine = Q.f32_to_e4m3(x)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = int((mine != theirs).sum())
    report("E4M3 rounding == torch float8_e4m3fn cast, |x| <= 448", bad == 0,
           f"{x.size} values (codes, midpoints, +-1 ulp of them, random), {bad} differ")
    # decoding: every finite code's value == torch's widening of it
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    tv = codes.view(torch.float8_e4m3fn).to(torch.float64).numpy()
    same = np.array_equal(np.isnan(tv), np.isnan(Q.E4M3_VALUES)) and \
        np.array_equal(tv[np.isfinite(tv)], Q.E4M3_VALUES[np.isfinite(Q.E4M3_VALUES)])
    report("E4M3 code values == torch float8_e4m3fn widening, all 256 codes (0x7f / 0xff NaN)", same)
    # §1 out of range: saturate, never NaN (torch's cast turns large values into NaN: not compared)
    big = np.array([448, 448.5, 463.99, 464, 480, 1e6, np.inf, 3.4e38], dtype=np.float32)
    c = Q.f32_to_e4m3(np.concatenate([big, -big, [np.nan]]).astype(np.float32))
    ok = all(c[:8] == 0x7E) and all(c[8:16] == 0xFE) and c[16] == 0x7F
    tb = torch.from_numpy(big).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    report("E4M3 saturation: 448 .. inf -> 0x7e, -448 .. -inf -> 0xfe, NaN -> 0x7f", bool(ok),
           f"(torch's cast of {big[1:6].tolist()} gives codes {[hex(b) for b in tb[1:6]]})")


C_PROGRAM = r"""
#include "kernels/shared/quant.h"
#include <stdio.h>
#include <stdlib.h>
/* stdin: u32 n, u32 rows, u32 cols, n f32 (element codes), rows*cols f32 (matrix);
 * stdout: n codes, rows*cols codes, rows f32 scales (ds_ptpc_quantize_act's arithmetic). */
int main(void) {
    unsigned hdr[3];
    if (fread(hdr, 4, 3, stdin) != 3) return 1;
    size_t n = hdr[0], R = hdr[1], K = hdr[2];
    float *x = malloc(4 * (n + R * K + 1));
    unsigned char *c = malloc(n + R * K + 1);
    float *s = malloc(4 * (R + 1));
    if (fread(x, 4, n + R * K, stdin) != n + R * K) return 1;
    for (size_t i = 0; i < n; i++) c[i] = ds_f32_to_e4m3(x[i]);
    for (size_t t = 0; t < R; t++) {
        const float *xr = x + n + t * K;
        float amax = 0.0f;
        for (size_t j = 0; j < K; j++) amax = fmaxf(amax, fabsf(xr[j]));
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
        s[t] = st;
        for (size_t j = 0; j < K; j++) c[n + t * K + j] = ds_f32_to_e4m3(xr[j] * inv);
    }
    fwrite(c, 1, n + R * K, stdout);
    fwrite(s, 4, R, stdout);
    /* then: u32 rows, u32 cols, packed [rows][cols/2], scales [rows][cols/32] -> f32 [rows][cols] */
    unsigned mh[2];
    if (fread(mh, 4, 2, stdin) != 2) return 1;
    size_t mr = mh[0], mc = mh[1];
    unsigned char *pk = malloc(mr * mc / 2), *sc = malloc(mr * mc / 32);
    if (fread(pk, 1, mr * mc / 2, stdin) != mr * mc / 2 || fread(sc, 1, mr * mc / 32, stdin) != mr * mc / 32)
        return 1;
    for (size_t r = 0; r < mr; r++)
        for (size_t j = 0; j < mc; j++) {
            float v = ds_mxfp4_at(pk, sc, (int)mc, (int)r, (int)j);
            fwrite(&v, 4, 1, stdout);
        }
    return 0;
}
"""


def check_against_c():
    cc = next((c for c in ("cc", "gcc", "clang") if subprocess.run(["sh", "-c", f"command -v {c}"],
                                                                     capture_output=True).returncode == 0), None)
    if cc is None:
        print("SKIP  C comparison: no C compiler")
        return
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "q.c"), os.path.join(d, "q")
        with open(src, "w") as f:
            f.write(C_PROGRAM)
        r = subprocess.run([cc, "-std=c11", "-O3", "-I", os.path.join(ROOT, "src"), src, "-o", exe, "-lm"],
                           capture_output=True, text=True)
        if r.returncode:
            report("C quant.h compiles", False, r.stderr[-500:])
            return
        rng = np.random.default_rng(1)
        x = test_values()
        big = np.array([448.5, 463.99, 464, 480, 1e6, np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
        x = np.concatenate([x, big]).astype(np.float32)
        # rows: BF16-valued weights, f32 activations of every magnitude, all-zero and one-hot rows
        R, K = 600, 96
        m = (rng.standard_normal((R, K)) * np.exp2(rng.uniform(-30, 20, (R, 1)))).astype(np.float32)
        m[:200] = torch.from_numpy(m[:200]).to(torch.bfloat16).to(torch.float32).numpy()
        m[200] = 0
        m[201] = 0
        m[201, 5] = 1e-30
        MR, MC = 64, 128
        pk = rng.integers(0, 256, (MR, MC // 2), dtype=np.uint8)
        sc = rng.integers(0, 255, (MR, MC // 32), dtype=np.uint8)
        sc[0, :] = [0, 1, 254, 127]
        inp = np.array([x.size, R, K], dtype=np.uint32).tobytes() + x.tobytes() + m.tobytes() + \
            np.array([MR, MC], dtype=np.uint32).tobytes() + pk.tobytes() + sc.tobytes()
        out = subprocess.run([exe], input=inp, capture_output=True).stdout
        cmx = np.frombuffer(out[-4 * MR * MC:], dtype=np.float32).reshape(MR, MC).astype(np.float64)
        out = out[: -4 * MR * MC]
        mine = Q.dequant_mxfp4(torch.from_numpy(pk), torch.from_numpy(sc)).numpy()
        fin = np.abs(mine) <= np.finfo(np.float32).max
        bad = np.argwhere(~fin | (mine != cmx))
        report("MXFP4 dequant == C ds_mxfp4_at, every element in f32 range (random bytes, E8M0 0 .. 254)",
               np.array_equal(mine[fin], cmx[fin]), f"{MR} x {MC}; {int((~fin).sum())} out of f32 range "
               f"(C: inf) {[(float(mine[tuple(i)]), float(cmx[tuple(i)])) for i in bad[:3]]}")
        cx = np.frombuffer(out[: x.size], dtype=np.uint8)
        cm = np.frombuffer(out[x.size: x.size + R * K], dtype=np.uint8).reshape(R, K)
        cs = np.frombuffer(out[x.size + R * K:], dtype=np.float32)
        report("E4M3 rounding == C ds_f32_to_e4m3 (incl. saturation, NaN, -0)",
               np.array_equal(cx, Q.f32_to_e4m3(x)), f"{x.size} values")
        codes, s = Q.ptpc_quantize_rows(m)
        report("ptpc codes and f32 scales == C (quant.h + matmul_quant.c's quantizer), bit for bit",
               np.array_equal(codes, cm) and np.array_equal(s.view(np.uint32), cs.view(np.uint32)),
               f"{R} rows x {K}, amax 2^-30 .. 2^20, zero and 1e-30 rows (min scale)")


def check_ptpc():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 96, generator=g, dtype=torch.float64) * 0.05).to(torch.bfloat16).to(torch.float64)
    w[3] = 0.0
    w[4, :] = float(np.float32(1e-9))  # below the minimum scale: everything is on the subnormal grid of 1/(448*512*512)
    q = Q.QMat("w", w)
    d = q.dequant()
    s = q.s.view(-1, 1)
    bound = torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10)  # half an E4M3 step, normal / subnormal
    report("ptpc dequant: |W - q*s| <= half a step (2^-4 |W| normal, 2^-10 s subnormal)",
           bool(((d - w).abs() <= bound * (1 + 1e-12)).all()),
           f"max rel {((d - w).abs().max() / w.abs().max()).item():.3g}")
    amax = w.abs().amax(1).to(torch.float32).numpy()
    want = np.maximum(amax / np.float32(448), np.float32(1) / np.float32(448 * 512))
    report("ptpc scales: max(amax/448, 1/(448*512)) of the row, in f32",
           np.array_equal(q.scales.view(np.uint32), want.astype(np.float32).view(np.uint32)))
    # fixed point: E4M3 values times powers of two (the row max a 448 code) quantize back to themselves
    codes = torch.randint(0, 0x7f, (32, 96), generator=g)
    codes[:, 0] = 0x7e  # 448
    vals = Q.E4M3_TORCH[codes] * torch.exp2(torch.randint(-17, 10, (32, 1), generator=g).to(torch.float64))
    vals = torch.where(torch.rand(32, 96, generator=g) < 0.5, -vals, vals)
    q2 = Q.QMat("v", vals)
    report("ptpc fixed point: quantize(dequantize) == identity on E4M3 x 2^k rows",
           torch.equal(q2.dequant(), vals) and torch.equal(Q.QMat("d", q2.dequant()).dequant(), vals))
    # §3 product, element by element: (sum_c xq*wq * s_t) * s_r
    x = torch.randn(5, 96, generator=g, dtype=torch.float64) * torch.tensor([[1e-3], [1], [30], [1e4], [0]],
                                                                               dtype=torch.float64)
    y = q.matmul(x)
    xc, xs = Q.ptpc_quantize_rows(x)
    ok = True
    for t in range(5):
        for r in (0, 3, 4, 17, 63):
            acc = sum(float(Q.E4M3_VALUES[xc[t, c]]) * float(Q.E4M3_VALUES[q.codes[r, c]]) for c in range(96))
            ok = ok and y[t, r].item() == (acc * float(xs[t])) * float(q.scales[r])
    report("ptpc product == (sum_c e4m3(x) e4m3(w) * s_t) * s_r element by element", ok)
    # a token's scale is its own: scaling one row of x scales only that row of y (by a power of two)
    x2 = x.clone()
    x2[1] *= 8
    y2 = q.matmul(x2)
    report("ptpc activation scale per token (one row x8 -> that row x8, others unchanged)",
           torch.equal(y2[1], y[1] * 8) and torch.equal(y2[[0, 2, 3, 4]], y[[0, 2, 3, 4]]))


def check_mxfp4():
    # byte 0x9B: element 0 = low nibble 0xB = -1.5, element 1 = high nibble 0x9 = -0.5
    pk = torch.tensor([[0x9B] + [0x07] * 15, [0x21] + [0x70] * 15, [0x0F] * 16], dtype=torch.uint8)
    sc = torch.tensor([[127], [0], [254]], dtype=torch.uint8)
    want = torch.tensor([[-1.5, -0.5] + [6.0, 0.0] * 15,
                         [0.5 * 2.0 ** -127, 1.0 * 2.0 ** -127] + [0.0, 6.0 * 2.0 ** -127] * 15,
                         [-6.0 * 2.0 ** 127, 0.0] * 16], dtype=torch.float64)
    got = Q.dequant_mxfp4(pk, sc)
    report("MXFP4: element 2i low nibble, 2i+1 high nibble; E8M0 127 = 1, 0 = 2^-127, 254 = 2^127",
           torch.equal(got, want))
    try:
        Q.dequant_mxfp4(pk, torch.tensor([[127], [255], [127]], dtype=torch.uint8), "layers.1.experts.0.w1")
        report("MXFP4: E8M0 byte 255 refused", False)
    except ValueError as e:
        report("MXFP4: E8M0 byte 255 refused, naming the tensor", "experts.0.w1" in str(e), f"({e})")
    for c in range(16):  # every code's value against the §1 table
        v = Q.dequant_mxfp4(torch.tensor([[c] * 16], dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
        mag = [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]
        if v[0, 0].item() != (-mag if c & 8 else mag) or not torch.equal(v[0, 1], torch.tensor(0.0, dtype=torch.float64)):
            report(f"MXFP4: code {c}", False)
            return
    report("MXFP4: all 16 E2M1 codes == {0,.5,1,1.5,2,3,4,6} with bit 3 the sign", True)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def check_model(path, tag, T, quick):
    from model import ReferenceModel
    ids = np.random.default_rng(5).integers(0, 1024, size=T)
    base = ReferenceModel.from_dir(path).forward(ids)
    configs = [("ptpc_fp8", dict(quantization="ptpc_fp8")), ("FP8 KV", dict(kv_cache_dtype="fp8"))]
    if not quick:
        configs.append(("ptpc_fp8 + FP8 KV", dict(quantization="ptpc_fp8", kv_cache_dtype="fp8")))
    for name, kw in configs:
        ref = ReferenceModel.from_dir(path, **kw)
        full = ref.forward(ids)
        inc = ref.forward_incremental(ids, chunks=[T // 2 + 1, 1, 3, 1])
        e_inc = max([rel(inc.logits, full.logits)] + [rel(a, b) for a, b in zip(inc.hidden, full.hidden)])
        report(f"[{tag}] {name}: prefill({T // 2 + 1}) + 1/3/1 decode == full forward, logits and all hidden",
               e_inc <= 1e-10, f"max rel {e_inc:.2g}")
        n = 24 if quick else 40
        tok = ref.forward_incremental(ids[:n], chunks=[1])
        e_tok = rel(tok.logits, full.logits[:n])
        report(f"[{tag}] {name}: token-by-token ({n}) == full forward", e_tok <= 1e-10, f"max rel {e_tok:.2g}")
        d = rel(full.logits, base.logits)
        report(f"[{tag}] {name}: differs from the unquantized model (it does something)", d > 1e-6,
               f"logits rel diff {d:.2g}")
        if "kv_cache_dtype" in kw:  # the cache holds code x tile-scale values and BF16 kR
            ok = True
            for st in inc.state:
                if hasattr(st, "kR"):
                    codes, scales = Q.fp8_kv_quantize_c(st.c)
                    ok = ok and torch.equal(Q.fp8_kv_dequant_c(codes, scales), st.c)
                    ok = ok and torch.equal(Q.bf16_round(st.kR), st.kR)
            report(f"[{tag}] {name}: every cached row is E4M3 x tile scale (c) and BF16 (kR)", ok)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", default=os.path.join(ROOT, "models", "tiny-k3"))
    ap.add_argument("--linear", default=os.path.join(ROOT, "models", "tiny-linear"))
    ap.add_argument("--quick", action="store_true", help="shorter sequences, fewer model configurations")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    check_e4m3_torch()
    check_against_c()
    check_ptpc()
    check_mxfp4()
    for path, tag in ((a.k3, "tiny-k3"), (a.linear, "tiny-linear")):
        if os.path.isfile(os.path.join(path, "config.json")):
            check_model(path, tag, 40 if a.quick else 80, a.quick)
        else:
            print(f"SKIP  whole-model checks on {path}: no checkpoint (deltaserve init-model --preset {tag})")
    n_fail = RESULTS.count(False)
    print(f"{len(RESULTS) - n_fail} passed, {n_fail} failed")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
