/* tf32.cuh — TF32, 3xTF32, BF16 and 3xBF16 products on tensor cores: one m16n8k8 step, the split
 * of a value into two TF32 (or BF16) parts, and an A fragment made once for several column
 * tiles. */
#pragma once

#include "kernels/cuda/common.cuh" /* pack_bf16x2 */

#include <stdint.h>

/* TF32 tensor cores (mma.sync m16n8k8, f32 accumulation), for chunked KDA's tensor-core modes
 * (kda_chunked.cu, ds_cu_set_kda_tc). Fragment layouts as the PTX ISA gives them for m16n8k8 TF32:
 * lane = 4 g + l4 holds A's (g, l4), (g + 8, l4), (g, l4 + 4), (g + 8, l4 + 4); B's (l4, g), (l4 +
 * 4, g); C's (g, 2 l4 (+1)) and (g + 8, 2 l4 (+1)). */
static __device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 3xTF32 (PREC 3): x = hi + lo, both TF32, and a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi: about
 * f32's accuracy on tensor cores (the a_lo b_lo term, ~2^-22 relative, is left out). PREC 1 is
 * plain TF32. An A fragment is split once and serves every column tile. */
static __device__ __forceinline__ void tf32_split(float x, uint32_t &hi, uint32_t &lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

/* PREC 2: BF16 operands on the BF16 m16n8k8 step (twice TF32's rate, FLA's chunk_kda precision),
 * fed from the same TF32-shaped fragments: its lane (g, l4) holds A's rows g and g + 8 and B's
 * column g at k slots 2 l4 and 2 l4 + 1, which here carry k = l4 and l4 + 4 — one permutation of
 * the eight k for A and B alike, so the product is the same sum. hi[0], hi[1] then hold the
 * packed pairs (a0, a2) and (a1, a3). */
static __device__ __forceinline__ void mma_bf16_k8(float (&d)[4], uint32_t a0, uint32_t a1,
                                                   uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, "
                 "{%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

/* PREC 4 (3xBF16): x = hi + lo, both BF16 (lo the rounded remainder, x - hi exact in f32), on
 * PREC 2's step: a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi, about 16 of f32's 24 bits (the parts
 * carry 8 + 8, the a_lo b_lo term ~2^-18 relative is left out) — three steps at twice TF32's
 * rate, so the cost of 1.5 TF32 steps where 3xTF32 costs 3. */
static __device__ __forceinline__ void bf16_split2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    hi = *(const uint32_t *)&h;
    lo = pack_bf16x2(x0 - hf.x, x1 - hf.y);
}

template <int PREC> struct tf32_a {
    uint32_t hi[4], lo[4]; /* lo unused at PREC 1 and 2, hi[2..3] (and lo[2..3]) at 2 and 4 */
    tf32_a() = default;    /* (PREC 2: hi[0], hi[1] set from packed BF16 pairs) */
    __device__ __forceinline__ tf32_a(float a0, float a1, float a2, float a3) {
        if constexpr (PREC == 2) {
            hi[0] = pack_bf16x2(a0, a2), hi[1] = pack_bf16x2(a1, a3);
            return;
        }
        if constexpr (PREC == 4) {
            bf16_split2(a0, a2, hi[0], lo[0]);
            bf16_split2(a1, a3, hi[1], lo[1]);
            return;
        }
        const float a[4] = {a0, a1, a2, a3};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (PREC == 3)
                tf32_split(a[i], hi[i], lo[i]);
            else
                hi[i] = to_tf32(a[i]);
        }
    }
};

template <int PREC>
static __device__ __forceinline__ void mma_tf32x(float (&d)[4], const tf32_a<PREC> &a, float b0,
                                                 float b1) {
    if constexpr (PREC == 3) {
        uint32_t h0, l0, h1, l1;
        tf32_split(b0, h0, l0);
        tf32_split(b1, h1, l1);
        mma_tf32(d, a.lo, h0, h1); /* the small terms first */
        mma_tf32(d, a.hi, l0, l1);
        mma_tf32(d, a.hi, h0, h1);
    } else if constexpr (PREC == 4) {
        uint32_t bh, bl;
        bf16_split2(b0, b1, bh, bl);
        mma_bf16_k8(d, a.lo[0], a.lo[1], bh); /* the small terms first */
        mma_bf16_k8(d, a.hi[0], a.hi[1], bl);
        mma_bf16_k8(d, a.hi[0], a.hi[1], bh);
    } else if constexpr (PREC == 2) {
        mma_bf16_k8(d, a.hi[0], a.hi[1], pack_bf16x2(b0, b1));
    } else {
        mma_tf32(d, a.hi, to_tf32(b0), to_tf32(b1));
    }
}
