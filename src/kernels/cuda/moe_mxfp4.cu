/* moe_mxfp4.cu — routed experts held as MXFP4 (docs/quantization.md: Kimi-K3's packed E2M1
 * codes with an E8M0 scale a group of 32), never widened in memory: the weight-streaming kernel
 * (decode, batch invariance: f32 activations, each weight exact) and the streaming tensor-core
 * kernel for batches (the weights dequantized in registers to BF16 A operands, the activations
 * BF16: w4a16). Grouping and combine are moe_experts.cu's. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/shared/quant.h"

/* 8 E2M1 codes (a word of packed bytes: element 2i in the low nibble of byte i, so the elements
 * follow the nibbles) as four BF16x2 pairs of their values at scale 1 (every one exact in BF16):
 * the magnitudes' high and low bytes looked up by byte permutes, the sign moved to bit 15. */
static __device__ __forceinline__ uint4 fp4x8_bf16(uint32_t w) {
    const uint32_t a = w & 0x7777u, b = (w >> 16) & 0x7777u, v = w >> 16;
    /* BF16 of {0, 0.5, 1, 1.5, 2, 3, 4, 6}: high bytes {00 3F 3F 3F 40 40 40 40}, low bytes
     * {00 00 80 C0 00 40 80 C0} */
    const uint32_t hi_a = __byte_perm(0x3F3F3F00u, 0x40404040u, a),
                   lo_a = __byte_perm(0xC0800000u, 0xC0804000u, a),
                   hi_b = __byte_perm(0x3F3F3F00u, 0x40404040u, b),
                   lo_b = __byte_perm(0xC0800000u, 0xC0804000u, b);
    uint4 r;
    r.x = __byte_perm(lo_a, hi_a, 0x5140) | ((w << 12) & 0x8000u) | ((w << 24) & 0x80000000u);
    r.y = __byte_perm(lo_a, hi_a, 0x7362) | ((w << 4) & 0x8000u) | ((w << 16) & 0x80000000u);
    r.z = __byte_perm(lo_b, hi_b, 0x5140) | ((v << 12) & 0x8000u) | ((v << 24) & 0x80000000u);
    r.w = __byte_perm(lo_b, hi_b, 0x7362) | ((v << 4) & 0x8000u) | ((v << 16) & 0x80000000u);
    return r;
}

/* 32 codes (one group, a 16-byte load) dotted with 32 f32 values at scale 1, in a fixed order.
 * The group's scale is a power of two, so multiplying the sum by it gives the sum of the scaled
 * terms exactly (the CPU's terms W x, each rounding the same). */
static __device__ __forceinline__ float dot32_fp4(uint4 u, const float *x) {
    return dot8(fp4x8_bf16(u.x), x) + dot8(fp4x8_bf16(u.y), x + 8) + dot8(fp4x8_bf16(u.z), x + 16) +
           dot8(fp4x8_bf16(u.w), x + 24);
}

/* ---- the streaming kernel -------------------------------------------------------------------
 * moe_grouped_k's scheme (block: 8 NPW weight rows of one active expert; up to rp of its routed
 * rows staged in shared memory, with act applied as they are staged for the down pass) on packed
 * rows: lane l takes groups l, l + 32, ... (16 bytes of codes and a scale byte each). A row's sum
 * takes the same operations however many rows share the pass (batch invariance). */
template <int RPM, int NPW>
__global__ void __launch_bounds__(256)
    moe_fp4_k(float *y, int ldy, const float *x, int ldx, int x_div, const uint8_t *Wc,
              const uint8_t *Ws, int N, int K, const int32_t *start, const int32_t *perm,
              const int32_t *active, const int32_t *n_active, int rp, moe_act act,
              const int32_t *direct, int e0, int E) {
    PDL_ENTRY();
    extern __shared__ float4 xsh[]; /* [rp][K] the pass's x rows */
    int e, r0, r1;
    if (direct) { /* block row y is routed row y (one token) */
        e = direct[blockIdx.y] - e0;
        if (e < 0 || e >= E) return;
        r0 = blockIdx.y, r1 = r0 + 1;
    } else {
        if ((int)blockIdx.y >= *n_active) return;
        e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    }
    const int lane = threadIdx.x & 31, ng = K / 32;
    const int n0 = blockIdx.x * 8 * NPW + (threadIdx.x >> 5) * NPW;
    const uint4 *wr[NPW];
    const uint8_t *sr[NPW];
#pragma unroll
    for (int j = 0; j < NPW; j++) {
        const size_t row = (size_t)e * N + min(n0 + j, N - 1);
        wr[j] = (const uint4 *)(Wc + row * (K / 2));
        sr[j] = Ws + row * ng;
    }
    for (int c0 = r0; c0 < r1; c0 += rp) {
        const int nr = min(rp, r1 - c0);
        __syncthreads(); /* the previous pass is done with xsh */
        for (int i = 0; i < nr; i++) {
            const int r = direct ? c0 + i : perm[c0 + i];
            const float4 *src = (const float4 *)(x + (size_t)(r / x_div) * ldx);
            for (int j = threadIdx.x; j < K / 4; j += blockDim.x) {
                float4 v = src[j];
                if (act.on) v = act_pair4(v, src[K / 4 + j], act.situ, act.beta, act.lin_beta);
                xsh[(size_t)i * (K / 4) + j] = v;
            }
        }
        __syncthreads();
        if (n0 >= N) continue;
        float acc[NPW][RPM];
#pragma unroll
        for (int j = 0; j < NPW; j++)
#pragma unroll
            for (int i = 0; i < RPM; i++) acc[j][i] = 0.0f;
#pragma unroll 2
        for (int gi = lane; gi < ng; gi += 32) {
            uint4 u[NPW];
            float sc[NPW];
#pragma unroll
            for (int j = 0; j < NPW; j++)
                u[j] = __ldg(wr[j] + gi), sc[j] = ds_e8m0_to_f32(sr[j][gi]);
#pragma unroll
            for (int j = 0; j < NPW; j++)
#pragma unroll
                for (int i = 0; i < RPM; i++)
                    if (i < nr)
                        acc[j][i] +=
                            dot32_fp4(u[j], (const float *)xsh + (size_t)i * K + gi * 32) * sc[j];
        }
#pragma unroll
        for (int i = 0; i < RPM; i++)
            if (i < nr) {
                const int r = direct ? c0 + i : perm[c0 + i];
#pragma unroll
                for (int j = 0; j < NPW; j++) {
                    float v = acc[j][i];
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0 && n0 + j < N) y[(size_t)r * ldy + n0 + j] = v;
                }
            }
    }
}

typedef void (*moe_fp4_ptr)(float *, int, const float *, int, int, const uint8_t *, const uint8_t *,
                            int, int, const int32_t *, const int32_t *, const int32_t *,
                            const int32_t *, int, moe_act, const int32_t *, int, int);
static const moe_fp4_ptr moe_fp4_fns[3] = {moe_fp4_k<1, 4>, moe_fp4_k<2, 4>, moe_fp4_k<8, 4>};
enum : size_t { MOE_FP4_SMEM = 160 * 1024 };

/* ---- tensor cores (batches) -------------------------------------------------------------------
 * moe_tc_body's scheme (moe_tensor.cu: each warp two 16-row weight tiles as m16n8k16 A operands
 * straight from memory, tokens as BF16 B operands, UP applying act in registers) with packed
 * weights: a 128-wide step of a row is 64 bytes, lane 4 g + l4 loading piece l4 (its group of 32:
 * codes and one scale) and the same 32 columns of its token's BF16 row; the codes become BF16
 * values times the scale (a power of two: exact) and feed the mma in the BF16 kernel's order. */
static __device__ __forceinline__ uint32_t bf2_mul(uint32_t p, __nv_bfloat162 s) {
    __nv_bfloat162 v = *(__nv_bfloat162 *)&p;
    v = __hmul2(v, s);
    return *(uint32_t *)&v;
}

static __device__ __forceinline__ __nv_bfloat162 e8m0_bf2(uint8_t b) {
    const uint16_t bits = b ? (uint16_t)(b << 7) : (uint16_t)0x0040; /* 2^(b - 127) */
    __nv_bfloat16 h = *(const __nv_bfloat16 *)&bits;
    return __nv_bfloat162(h, h);
}

template <int NT, bool UP>
__global__ void __launch_bounds__(256)
    moe_tc4_k(void *out, int ldo, const __nv_bfloat16 *xb, const uint8_t *Wc, const uint8_t *Ws,
              int N, int K, const int32_t *start, const int32_t *perm, const int32_t *active,
              const int32_t *n_active, moe_act act) {
    PDL_ENTRY();
    if ((int)blockIdx.y >= *n_active) return;
    const int e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    const int c0 = (blockIdx.x * 8 + warp) * (UP ? 16 : 32);
    if (c0 >= N) return;
    const size_t erows = UP ? 2 * (size_t)N : (size_t)N;
    const uint4 *wr[2][2]; /* [tile][row g, g + 8], at this lane's piece of the first step */
    const uint8_t *sr[2][2];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = UP ? m * N + c0 + g + 8 * h : min(c0 + 16 * m + g + 8 * h, N - 1);
            const size_t rr = (size_t)e * erows + row;
            wr[m][h] = (const uint4 *)(Wc + rr * (K / 2)) + l4;
            sr[m][h] = Ws + rr * (K / 32) + l4;
        }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = r0; p0 < r1; p0 += 8 * NT) {
        float acc[2][NT][4];
        const uint4 *xr[NT];
        bool xv[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int r = p0 + nt * 8 + g;
            xv[nt] = r < r1;
            xr[nt] = (const uint4 *)(xb + (size_t)(xv[nt] ? r : r0) * K) + 4 * l4;
#pragma unroll
            for (int i = 0; i < 4; i++) acc[0][nt][i] = acc[1][nt][i] = 0.0f;
        }
        for (int s = 0; s < K / 128; s++) {
            uint4 a[2][2];
            __nv_bfloat162 sc[2][2];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    a[m][h] = __ldg(wr[m][h] + 4 * s);
                    sc[m][h] = e8m0_bf2(sr[m][h][4 * s]);
                }
#pragma unroll
            for (int p = 0; p < 4; p++) { /* codes word p: columns [32 l4 + 8 p, + 8) */
                uint4 b[NT];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) b[nt] = xv[nt] ? __ldg(xr[nt] + 16 * s + p) : zero;
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint32_t w0 = p == 0   ? a[m][0].x
                                        : p == 1 ? a[m][0].y
                                        : p == 2 ? a[m][0].z
                                                 : a[m][0].w;
                    const uint32_t w1 = p == 0   ? a[m][1].x
                                        : p == 1 ? a[m][1].y
                                        : p == 2 ? a[m][1].z
                                                 : a[m][1].w;
                    const uint4 d0 = fp4x8_bf16(w0), d1 = fp4x8_bf16(w1);
                    const uint32_t lo[4] = {bf2_mul(d0.x, sc[m][0]), bf2_mul(d1.x, sc[m][1]),
                                            bf2_mul(d0.y, sc[m][0]), bf2_mul(d1.y, sc[m][1])},
                                   hi[4] = {bf2_mul(d0.z, sc[m][0]), bf2_mul(d1.z, sc[m][1]),
                                            bf2_mul(d0.w, sc[m][0]), bf2_mul(d1.w, sc[m][1])};
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        mma_16816(acc[m][nt], lo, b[nt].x, b[nt].y);
                        mma_16816(acc[m][nt], hi, b[nt].z, b[nt].w);
                    }
                }
            }
        }
        /* C: rows g (elements 0, 1) and g + 8 (2, 3) of a tile, tokens 2 l4 and 2 l4 + 1 */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int r = p0 + nt * 8 + 2 * l4 + j;
                if (r >= r1) continue;
                if (UP) {
                    __nv_bfloat16 *ab = (__nv_bfloat16 *)out + (size_t)r * ldo + c0 + g;
                    ab[0] = __float2bfloat16_rn(
                        act_pair(acc[0][nt][j], acc[1][nt][j], act.situ, act.beta, act.lin_beta));
                    ab[8] = __float2bfloat16_rn(act_pair(acc[0][nt][2 + j], acc[1][nt][2 + j],
                                                         act.situ, act.beta, act.lin_beta));
                } else {
                    float *yr = (float *)out + (size_t)perm[r] * ldo;
#pragma unroll
                    for (int m = 0; m < 2; m++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int row = c0 + 16 * m + g + 8 * h;
                            if (row < N) yr[row] = acc[m][nt][2 * h + j];
                        }
                }
            }
    }
}

/* xb[i] = bf16(x[perm[i] / k]) for this rank's routed rows i < start[E], in expert order */
__global__ void moe_fp4_gather_k(__nv_bfloat16 *xb, const float *x, int D, const int32_t *perm,
                                 const int32_t *start, int E, int k) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    if (i >= start[E]) return;
    const float4 *xr = (const float4 *)(x + (size_t)(perm[i] / k) * D);
    for (int c4 = threadIdx.x; c4 < D / 4; c4 += blockDim.x)
        store_bf16x4(xb + (size_t)i * D + 4 * c4, xr[c4]);
}

typedef void (*moe_tc4_ptr)(void *, int, const __nv_bfloat16 *, const uint8_t *, const uint8_t *,
                            int, int, const int32_t *, const int32_t *, const int32_t *,
                            const int32_t *, moe_act);
static const moe_tc4_ptr moe_tc4_up[3] = {moe_tc4_k<1, true>, moe_tc4_k<2, true>,
                                          moe_tc4_k<4, true>},
                         moe_tc4_dn[3] = {moe_tc4_k<1, false>, moe_tc4_k<2, false>,
                                          moe_tc4_k<4, false>};

/* Tokens from which a step's MXFP4 experts run on tensor cores (the BF16 experts' bound). */
enum { MOE_FP4_MMA_MIN = 40 };

typedef struct fp4_w {
    const uint8_t *gc, *gs, *dc, *ds; /* gate_up codes, scales; down codes, scales */
} fp4_w;

/* the two passes on tensor cores: xb [rows][D] then ab [rows][I] BF16 in h's place */
static void fp4_tc(ds_cu *c, float *h, float *y, const float *x, int rows, unsigned ya, int D,
                   int I, int E, int k, const fp4_w *w, const int32_t *start, const int32_t *perm,
                   const int32_t *active, const int32_t *n_active, moe_act act) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    __nv_bfloat16 *xb = (__nv_bfloat16 *)h, *ab = xb + (size_t)rows * D;
    const int per = (rows + (int)ya - 1) / (int)ya, nt = per <= 4 ? 0 : per <= 12 ? 1 : 2;
    launch_k(c, moe_fp4_gather_k, (unsigned)rows, 128, 0, xb, x, D, perm, start, E, k);
    launch_k(c, moe_tc4_up[nt], dim3((unsigned)((I + 127) / 128), ya), 256, 0, (void *)ab, I,
             (const __nv_bfloat16 *)xb, w->gc, w->gs, I, D, start, perm, active, n_active, act);
    launch_k(c, moe_tc4_dn[nt], dim3((unsigned)((D + 255) / 256), ya), 256, 0, (void *)y, D,
             (const __nv_bfloat16 *)ab, w->dc, w->ds, D, I, start, perm, active, n_active, none);
}

/* the two passes through the streaming kernel */
static int fp4_stream(ds_cu *c, float *h, float *y, const float *x, int T, int rows, unsigned ya,
                      int D, int I, int E, int e0, int k, const fp4_w *w, const int32_t *start,
                      const int32_t *perm, const int32_t *active, const int32_t *n_active,
                      const int32_t *direct, moe_act act, ds_err *err) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    if (!c->moe_fp4_smem) { /* once, before any capture can be open */
        for (int i = 0; i < 3; i++)
            CU_TRY(cudaFuncSetAttribute((const void *)moe_fp4_fns[i],
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)MOE_FP4_SMEM),
                   "moe mxfp4: shared memory");
        c->moe_fp4_smem = 1;
    }
    /* accumulators as the BF16 kernel sizes them (the bits do not depend on it) */
    const int rpm = T == 1 ? 1 : rows <= E ? 2 : 8, fi = T == 1 ? 0 : rows <= E ? 1 : 2;
    const int rp_up = DS_MAX(1, DS_MIN(DS_MIN(rpm, T), (int)(MOE_FP4_SMEM / ((size_t)D * 4))));
    const int rp_dn = DS_MAX(1, DS_MIN(DS_MIN(rpm, T), (int)(MOE_FP4_SMEM / ((size_t)I * 4))));
    launch_k(c, moe_fp4_fns[fi], dim3((unsigned)((2 * I + 31) / 32), ya), 256,
             (size_t)rp_up * D * 4, h, 2 * I, x, D, k, w->gc, w->gs, 2 * I, D, start, perm, active,
             n_active, rp_up, none, direct, e0, E);
    CU_TRY(cudaGetLastError(), "moe mxfp4 up");
    launch_k(c, moe_fp4_fns[fi], dim3((unsigned)((D + 31) / 32), ya), 256, (size_t)rp_dn * I * 4, y,
             D, h, 2 * I, 1, w->dc, w->ds, D, I, start, perm, active, n_active, rp_dn, act, direct,
             e0, E);
    CU_TRY(cudaGetLastError(), "moe mxfp4 down");
    return DS_OK;
}

extern "C" int ds_cu_moe_experts_mxfp4(ds_cu *c, float *out, const float *x, const int32_t *idx,
                                       const float *w, int T, int k, int E, int e0, int D, int I,
                                       const uint8_t *gu_codes, const uint8_t *gu_scales,
                                       const uint8_t *dn_codes, const uint8_t *dn_scales, int situ,
                                       float situ_beta, float situ_lin_beta, int accumulate,
                                       ds_err *err) {
    if (T <= 0 || k <= 0) return DS_OK;
    const int rows = T * k;
    if (rows > 65535) return ds_errf(err, "cuda: moe mxfp4: %d routed rows (at most 65535)", rows);
    if (D % 32 || I % 32 || (uintptr_t)x % 16 || E <= 0)
        return ds_errf(err, "cuda: moe mxfp4: widths %d and %d (multiples of 32 wanted)", D, I);
    const int n_chunks = rows >= 1024 ? (rows + MOE_GCHUNK - 1) / MOE_GCHUNK : 0;
    /* floats: h [rows][2I] (or the BF16 x [rows][D] and act [rows][I]), y [rows][D]; ints:
     * start [E+1], perm [rows], active [E], n [1], hist [n_chunks][E] */
    const size_t hf = (size_t)rows * DS_MAX(2 * (size_t)I, ((size_t)D + (size_t)I + 1) / 2);
    const size_t nf = hf + (size_t)rows * D;
    const size_t ni = (size_t)E + 1 + rows + E + 1 + (size_t)n_chunks * E;
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, (nf + ni) * sizeof(float), "moe scratch",
                     err))
        return DS_ERR;
    float *h = c->part, *y = c->part + hf;
    int32_t *start = (int32_t *)(c->part + nf), *perm = start + E + 1, *active = perm + rows;
    int32_t *n_active = active + E, *hist = n_active + 1;
    const unsigned ya = (unsigned)DS_MIN(E, rows);
    const int32_t *direct = T == 1 ? idx : NULL;
    ds_cu_prof_mark(c, "moe group");
    if (!direct) moe_group_rows(c, idx, rows, e0, E, n_chunks, start, perm, active, n_active, hist);
    CU_TRY(cudaGetLastError(), "moe mxfp4 group");
    ds_cu_prof_mark(c, "moe mxfp4 experts");
    const fp4_w fw = {gu_codes, gu_scales, dn_codes, dn_scales};
    const moe_act act = {1, situ, situ_beta, situ_lin_beta};
    const int tc = !direct && c->expert_mma && !c->batch_invariant && D % 128 == 0 &&
                   I % 128 == 0 &&
                   T >= (c->mma_min_tokens > 0 ? c->mma_min_tokens : MOE_FP4_MMA_MIN);
    if (tc) {
        fp4_tc(c, h, y, x, rows, ya, D, I, E, k, &fw, start, perm, active, n_active, act);
        CU_TRY(cudaGetLastError(), "moe mxfp4 (tensor cores)");
    } else if (fp4_stream(c, h, y, x, T, rows, ya, D, I, E, e0, k, &fw, start, perm, active,
                          n_active, direct, act, err)) {
        return DS_ERR;
    }
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    ds_cu_prof_mark(c, "moe combine");
    moe_combine(c, out, y, w, idx, e0, E, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe mxfp4 combine");
    return DS_OK;
}
