/* moe_mxfp4.cu — routed experts held as MXFP4 (docs/quantization.md: Kimi-K3's packed E2M1
 * codes with an E8M0 scale a group of 32), never widened in memory: the weight-streaming kernel
 * (decode, batch invariance: f32 activations split exactly into BF16 parts, each product exact,
 * on tensor cores) and the streaming tensor-core kernel for batches (the weights dequantized in
 * registers to BF16 A operands, the activations BF16: w4a16). Grouping and combine are
 * moe_experts.cu's. */
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

/* ---- the streaming kernel ---------------------------------------------------------------------
 * moe_fp8.cu's moe_f8m_k on packed rows: a warp a 16-row tile of an active expert's weights (S
 * warps sharing it along K, their partial sums added in order p = 0, 1, ..), up to 8 routed rows a
 * pass as the mma's columns (their operand rows staged in shared memory by the block). A 128-wide
 * step of a row is 64 bytes: lane 4 g + l4 streams group 4 s + l4 of its rows g and g + 8 (16
 * bytes of codes through its cp.async ring, a scale byte each: words of four shuffled across the
 * quad). The codes become BF16
 * values times their group's scale (a power of two: exact) and each f32 activation arrives as
 * three BF16 parts that sum to it exactly (fp4_split3), so every product is exact and the sums
 * are f32 (tensor cores, one accumulator a part): the CPU's terms, another order of the sums. A
 * column does not depend on the others and S on the matrix alone, so a routed row's result is
 * the same whatever else the step holds (batch invariance).
 *
 * The up pass's tile is 8 gate rows (g) and the 8 up rows of the same outputs (g + 8), so a lane
 * holds both halves of its act values: it applies act and writes the down pass's operands (the
 * parts of act(gate, up)) itself. The up pass's operands come from moe_fp4_split_k. */

/* The parts carry 2^FP4_XSH and the codes' multipliers 2^-FP4_XSH (products unchanged): the
 * exact range is then |x| < 2^95 and scales 2^-100 .. 2^33. */
enum { FP4_XSH = 32 };

/* x * 2^FP4_XSH as three BF16 parts, largest first, summing to it exactly (each residual is
 * exact in f32; the third holds at most 8 significant bits). */
static __device__ __forceinline__ void fp4_split3(float x, __nv_bfloat16 (&b)[3]) {
    x *= 4294967296.0f; /* 2^FP4_XSH */
    b[0] = __float2bfloat16_rn(x);
    float r = x - __bfloat162float(b[0]);
    b[1] = __float2bfloat16_rn(r);
    r -= __bfloat162float(b[1]);
    b[2] = __float2bfloat16_rn(r);
}

/* A row's operands in P parts (3: the exact split; 1: the first part alone, the one-part form):
 * [step K / 128 (rounded up)][word p 4][q P][l4 4] uint4, where lane l4's P uint4 of word p,
 * [h 2][part P][b0, b1] u32, feed the mmas of word p of its group 4 s + l4: half h takes pairs
 * 2 h (b0) and 2 h + 1 (b1), pair j holding activations 8 p + j (low) and 8 p + j + 4 (high), the
 * order fp4x8_bf16s decodes the codes in. The four lanes of a load read 64 contiguous bytes. */
static __host__ __device__ __forceinline__ size_t fp4_row_u32(int K, int P) {
    return (size_t)((K + 127) / 128) * 4 * 16 * P;
}

/* u32 index of word m < 4 P (of [h][part][b0, b1]) of activation word p of group grp */
template <int P> static __device__ __forceinline__ int fp4_u32(int grp, int p, int m) {
    return (((grp >> 2) * 4 * P + p * P + (m >> 2)) * 4 + (grp & 3)) * 4 + (m & 3);
}

template <int P>
static __device__ __forceinline__ void fp4_store_parts(uint32_t *row, int i, float v) {
    __nv_bfloat16 b[3];
    fp4_split3(v, b);
    const int c = i & 31, j = c & 3;
    __nv_bfloat16 *o = (__nv_bfloat16 *)row + ((c >> 2) & 1);
#pragma unroll
    for (int t = 0; t < P; t++)
        o[2 * fp4_u32<P>(i >> 5, c >> 3, ((j >> 1) * P + t) * 2 + (j & 1))] = b[t];
}

/* xs[r] = the operands (P parts) of x row r < rows, one thread a word (8 activations) */
template <int P> __global__ void moe_fp4_split_k(uint32_t *xs, const float *x, int K, int rows) {
    PDL_ENTRY();
    const int nw = K / 8;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * nw;
         i += gridDim.x * blockDim.x) {
        const int r = i / nw, w = i % nw;
        const float4 *src = (const float4 *)(x + (size_t)r * K + 8 * w);
        const float4 v0 = src[0], v1 = src[1];
        const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        uint32_t o[4 * P]; /* [h][part][b0, b1] */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            __nv_bfloat16 lo[3], hi[3];
            fp4_split3(v[j], lo);
            fp4_split3(v[j + 4], hi);
#pragma unroll
            for (int t = 0; t < P; t++)
                o[((j >> 1) * P + t) * 2 + (j & 1)] = (uint32_t)__bfloat16_as_ushort(lo[t]) |
                                                      ((uint32_t)__bfloat16_as_ushort(hi[t]) << 16);
        }
        uint32_t *row = xs + (size_t)r * fp4_row_u32(K, P);
#pragma unroll
        for (int q = 0; q < P; q++)
            *(uint4 *)(row + fp4_u32<P>(w >> 2, w & 3, 4 * q)) =
                make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
    }
}

/* BF16 2^(b - 1 - FP4_XSH): an E8M0 scale times 2^126 (see fp4x8_bf16s) and 2^-FP4_XSH */
static __device__ __forceinline__ __nv_bfloat162 fp4_mul(uint32_t b) {
    const uint16_t bits = (uint16_t)(min(b + 94u, 254u) << 7);
    const __nv_bfloat16 h = __ushort_as_bfloat16(bits);
    return __nv_bfloat162(h, h);
}

/* 8 E2M1 codes (a word: code j in nibble j) times mul as four BF16 pairs, pair j holding codes j
 * and j + 4: a code's sign and magnitude bits placed as BF16 s << 15 | m << 6 read as its value
 * times 2^-126 (the subnormal code 0.5 too), which mul restores. */
static __device__ __forceinline__ void fp4x8_bf16s(uint32_t w, __nv_bfloat162 mul,
                                                   uint32_t (&d)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t q = w << (12 - 4 * j); /* codes j, j + 4 in nibbles 3 and 7 */
        d[j] = bf2_mul((q & 0x80008000u) | ((q >> 6) & 0x01C001C0u), mul);
    }
}

/* Each lane streams its own codes through a ring of FP4_D steps in shared memory (cp.async: the
 * loads stay in flight while the warp decodes), a group of copies a step; it reads back only what
 * it copied itself, so no lane waits on another. */
enum { FP4_D = 4 };
static __device__ __forceinline__ void fp4_cp16(uint4 *smem, const uint4 *gmem) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem));
}
template <int N> static __device__ __forceinline__ void fp4_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/* The ring is touched through volatile asm alone (kept in order among themselves), so the
 * compiler may still move the operands' loads ahead of a step's wait. */
static __device__ __forceinline__ uint4 fp4_lds16(const uint4 *smem) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(sa));
    return v;
}

/* the scale bytes of groups grp .. grp + 3 of a row (ng a row) as a word, byte i group grp + i */
static __device__ __forceinline__ uint32_t fp4_sw(const uint8_t *row, int grp, int ng) {
    if (ng % 4 == 0) return __ldg((const uint32_t *)(row + grp));
    return (uint32_t)__ldg(row + grp) | (uint32_t)__ldg(row + grp + 1) << 8 |
           (uint32_t)__ldg(row + grp + 2) << 16 | (uint32_t)__ldg(row + grp + 3) << 24;
}

/* One step: a lane's 32 codes of rows g (a0) and g + 8 (a1) with their scale bytes against its
 * 4 P uint4 of operands at xb (zeros where xv is false: past the row).
 * ONE (batch invariance off, ds_cu_set_fp4_one_part): the activations' first part alone (x
 * rounded to BF16 once: w4a16, as the tensor-core path for batches; operands one part wide) — a
 * third of the mma and of the operand loads (bench/RESULTS.md session 48 counts the step's
 * instructions). (The groups' scales stay on the codes: an mma's k runs over the four groups of a
 * quad's lanes, so its sums have no single scale to apply afterwards.) */
template <bool ONE = false>
static __device__ __forceinline__ void fp4_mma_step(float (&acc)[3][4], uint4 a0, uint4 a1,
                                                    uint32_t sb0, uint32_t sb1, const uint4 *xb,
                                                    bool xv) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const __nv_bfloat162 m0 = fp4_mul(sb0), m1 = fp4_mul(sb1);
    const uint32_t A0[4] = {a0.x, a0.y, a0.z, a0.w}, A1[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint32_t d0[4], d1[4];
        fp4x8_bf16s(A0[p], m0, d0);
        fp4x8_bf16s(A1[p], m1, d1);
        constexpr int P = ONE ? 1 : 3;
        uint32_t B[4 * P]; /* [h][part][b0, b1] */
#pragma unroll
        for (int q = 0; q < P; q++) {
            const uint4 v = xv ? xb[(P * p + q) * 4] : zero;
            B[4 * q] = v.x, B[4 * q + 1] = v.y, B[4 * q + 2] = v.z, B[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint32_t fr[4] = {d0[2 * h], d1[2 * h], d0[2 * h + 1], d1[2 * h + 1]};
            /* ONE: half h into accumulator h (two chains of sums, added at the end) */
#pragma unroll
            for (int t = 0; t < P; t++)
                mma_16816(acc[ONE ? h : t], fr, B[(h * P + t) * 2], B[(h * P + t) * 2 + 1]);
        }
    }
}

/* xsh[j] = operand row (perm ? perm[j] : p0 + j) / x_div of xs, j < nt (rowq uint4 a row), by
 * the whole block */
static __device__ __forceinline__ void fp4_stage(uint4 *xsh, const uint32_t *xs, int rowq, int nt,
                                                 const int32_t *perm, int p0, int x_div) {
    for (int j = 0; j < nt; j++) {
        const int r = perm ? perm[j] : p0 + j;
        const uint4 *src = (const uint4 *)xs + (size_t)(r / x_div) * rowq;
        for (int q = threadIdx.x; q < rowq; q += blockDim.x)
            xsh[(size_t)j * rowq + q] = __ldg(src + q);
    }
}

/* UP: out = the down pass's operands [routed row][fp4_row_u32(N, P)] of act(gate, up), N = I (the
 * weights 2 N rows: gate then up); else out = y [routed row][ldo] f32. xs [.][fp4_row_u32(K, P)]:
 * the operands of source row r / x_div, nb rows of them a pass. A column past the pass's routed
 * rows reads column 0's operands (its sums are dropped; the loads of a quad of lanes stay one
 * line). P = ONE ? 1 : 3 parts; the one-part form's smaller operands leave room for three blocks
 * an SM (at two the kernel is bound by each warp's chain: bench/RESULTS.md session 49). */
template <bool UP, int S, bool ONE = false>
__global__ void __launch_bounds__(256, ONE ? 3 : 2)
    moe_fp4m_k(void *out, int ldo, const uint32_t *xs, int x_div, const uint8_t *Wc,
               const uint8_t *Ws, int N, int K, const int32_t *start, const int32_t *perm,
               const int32_t *active, const int32_t *n_active, moe_act act, const int32_t *direct,
               int e0, int E, int nb) {
    PDL_ENTRY();
    __shared__ float4 red[8][32];                  /* [warp][lane] partial sums (S > 1) */
    __shared__ uint4 fp4_ring[8 * FP4_D * 2 * 32]; /* [warp][step slot][row g, g + 8][lane] */
    constexpr int P = ONE ? 1 : 3;
    extern __shared__ uint4 xsh[]; /* [nb][fp4_row_u32(K, P) / 4] the pass's operands */
    int e, r0, r1;
    if (direct) { /* block row y is routed row y (one token) */
        e = direct[blockIdx.y] - e0;
        if (e < 0 || e >= E) return;
        r0 = blockIdx.y, r1 = r0 + 1;
    } else {
        if ((int)blockIdx.y >= *n_active) return;
        e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, l4 = lane & 3;
    const int tiles = UP ? N / 8 : N / 16, ng = K / 32, ns = K / 128;
    const int tile = blockIdx.x * (8 / S) + warp / S, part = warp % S, tc = min(tile, tiles - 1);
    /* this lane's rows: gate and up row of output 8 tile + g, or rows 16 tile + g and + 8 */
    const size_t ra = (size_t)e * (UP ? 2 * N : N) + (UP ? 8 * tc : 16 * tc) + g;
    const size_t rb = ra + (UP ? N : 8);
    const uint4 *w0 = (const uint4 *)(Wc + ra * (K / 2)) + l4 + 4 * part;
    const uint4 *w1 = (const uint4 *)(Wc + rb * (K / 2)) + l4 + 4 * part;
    const uint8_t *s0 = Ws + ra * ng, *s1 = Ws + rb * ng; /* the rows' scales */
    const bool tail = part == 0 && 4 * ns + l4 < ng;      /* this lane's group of the last step */
    const int n_i = ns > part ? (ns - part + S - 1) / S : 0; /* this warp's full steps */
    uint4 *ring = fp4_ring + (size_t)warp * (FP4_D * 2 * 32);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const int rowq = (int)(fp4_row_u32(K, P) / 4); /* uint4 of operands a row */
    for (int p0 = r0; p0 < r1; p0 += nb) {
        const int nt = min(nb, r1 - p0), cg = g < nt ? g : 0;
#pragma unroll
        for (int u = 0; u < FP4_D; u++) { /* steps 0 .. FP4_D - 1 in flight, a group each */
            if (u < n_i) {
                fp4_cp16(ring + (2 * u) * 32 + lane, w0 + 4 * u * S);
                fp4_cp16(ring + (2 * u + 1) * 32 + lane, w1 + 4 * u * S);
            }
            cp_async_commit();
        }
        __syncthreads(); /* the previous pass is done with xsh */
        fp4_stage(xsh, xs, rowq, nt, direct ? NULL : perm + p0, p0, x_div);
        __syncthreads();
        const uint4 *xr = xsh + (size_t)cg * rowq + l4;
        const uint4 *xp = xr + 16 * P * part; /* (16 P uint4 a step) */
        float acc[3][4];
#pragma unroll
        for (int t = 0; t < 3; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
        /* scale words: lane l4 holds step i0 + l4's four bytes of rows g and g + 8 */
        uint32_t c0 = 0u, c1 = 0u;
        if (l4 < n_i)
            c0 = fp4_sw(s0, 4 * (part + l4 * S), ng), c1 = fp4_sw(s1, 4 * (part + l4 * S), ng);
        for (int i0 = 0; i0 < n_i; i0 += FP4_D) {
            uint32_t n0 = 0u, n1 = 0u;
            if (i0 + FP4_D + l4 < n_i) {
                const int grp = 4 * (part + (i0 + FP4_D + l4) * S);
                n0 = fp4_sw(s0, grp, ng), n1 = fp4_sw(s1, grp, ng);
            }
#pragma unroll
            for (int u = 0; u < FP4_D; u++) {
                const int i = i0 + u; /* step part + i S, in slot u */
                if (i >= n_i) break;
                const uint32_t b0 =
                    (__shfl_sync(0xffffffffu, c0, (lane & ~3) | u) >> (8 * l4)) & 0xffu;
                const uint32_t b1 =
                    (__shfl_sync(0xffffffffu, c1, (lane & ~3) | u) >> (8 * l4)) & 0xffu;
                fp4_cp_wait<FP4_D - 1>();
                const uint4 a0 = fp4_lds16(ring + (2 * u) * 32 + lane),
                            a1 = fp4_lds16(ring + (2 * u + 1) * 32 + lane);
                fp4_mma_step<ONE>(acc, a0, a1, b0, b1, xp + 16 * P * S * i, true);
                if (i + FP4_D < n_i) { /* step i + FP4_D into the slot just read */
                    const int o = 4 * (i + FP4_D) * S;
                    fp4_cp16(ring + (2 * u) * 32 + lane, w0 + o);
                    fp4_cp16(ring + (2 * u + 1) * 32 + lane, w1 + o);
                }
                cp_async_commit();
            }
            c0 = n0, c1 = n1;
        }
        if (part == 0 && ng % 4) /* the narrower last step, zeros past the row */
            fp4_mma_step<ONE>(acc, tail ? __ldg(w0 + 4 * ns) : zero,
                              tail ? __ldg(w1 + 4 * ns) : zero, tail ? __ldg(s0 + 4 * ns + l4) : 0u,
                              tail ? __ldg(s1 + 4 * ns + l4) : 0u, xr + 16 * P * ns, tail);
#pragma unroll
        for (int i = 0; i < 4; i++) acc[0][i] += acc[1][i] + acc[2][i];
        if (S > 1) {
            __syncthreads(); /* the previous pass is done with red */
            red[warp][lane] = make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
            __syncthreads();
            if (part) continue;
            acc[0][0] = acc[0][1] = acc[0][2] = acc[0][3] = 0.0f;
            for (int p = 0; p < S; p++) {
                const float4 v = red[warp + p][lane];
                acc[0][0] += v.x, acc[0][1] += v.y, acc[0][2] += v.z, acc[0][3] += v.w;
            }
        }
        if (tile >= tiles) continue;
            /* C: rows g (elements 0, 1) and g + 8 (2, 3), routed rows 2 l4 and 2 l4 + 1 */
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int t = 2 * l4 + j;
            if (t >= nt) continue;
            const int r = direct ? p0 + t : perm[p0 + t];
            if (UP) {
                const float v =
                    act_pair(acc[0][j], acc[0][2 + j], act.situ, act.beta, act.lin_beta);
                fp4_store_parts<P>((uint32_t *)out + (size_t)r * fp4_row_u32(N, P), 8 * tile + g,
                                   v);
            } else {
                float *yr = (float *)out + (size_t)r * ldo + 16 * tile + g;
                yr[0] = acc[0][j], yr[8] = acc[0][2 + j];
            }
        }
    }
}

typedef void (*moe_fp4m_ptr)(void *, int, const uint32_t *, int, const uint8_t *, const uint8_t *,
                             int, int, const int32_t *, const int32_t *, const int32_t *,
                             const int32_t *, moe_act, const int32_t *, int, int, int);
static const moe_fp4m_ptr moe_fp4m_up[2][4] =
    {{moe_fp4m_k<true, 1>, moe_fp4m_k<true, 2>, moe_fp4m_k<true, 4>, moe_fp4m_k<true, 8>},
     {moe_fp4m_k<true, 1, true>, moe_fp4m_k<true, 2, true>, moe_fp4m_k<true, 4, true>,
      moe_fp4m_k<true, 8, true>}},
                          moe_fp4m_dn[2][4] = {
                              {moe_fp4m_k<false, 1>, moe_fp4m_k<false, 2>, moe_fp4m_k<false, 4>,
                               moe_fp4m_k<false, 8>},
                              {moe_fp4m_k<false, 1, true>, moe_fp4m_k<false, 2, true>,
                               moe_fp4m_k<false, 4, true>, moe_fp4m_k<false, 8, true>}};

/* log2 of the warps a tile (S): a function of the matrix alone (batch invariance). */
static int fp4_splits(int tiles, int K) {
    int l = 0;
    while (l < 3 && tiles << l < 128 && K / 128 >= 4 << l) l++;
    return l;
}

/* ---- tensor cores (batches) -------------------------------------------------------------------
 * moe_tc_body's scheme (moe_tensor.cu: each warp two 16-row weight tiles as m16n8k16 A operands
 * straight from memory, tokens as BF16 B operands, UP applying act in registers) with packed
 * weights: a 128-wide step of a row is 64 bytes, lane 4 g + l4 loading piece l4 (its group of 32:
 * codes and one scale) and the same 32 columns of its token's BF16 row; the codes become BF16
 * values times the scale (a power of two: exact) and feed the mma in the BF16 kernel's order. */
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
            const size_t rr = moe_mma_row<UP>(e, erows, N, c0, g, m, h);
            wr[m][h] = (const uint4 *)(Wc + rr * (K / 2)) + l4;
            sr[m][h] = Ws + rr * (K / 32) + l4;
        }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = r0; p0 < r1; p0 += 8 * NT) {
        float acc[2][NT][4];
        const uint4 *xr[NT];
        bool xv[NT];
        moe_mma_tokens<NT>(xr, xv, acc, xb, K, p0, r0, r1, g, 4 * l4);
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
        moe_mma_store<NT, UP>(out, ldo, acc, perm, p0, r1, c0, N, g, l4, act);
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

/* Operand rows a block stages, at most (shared memory: two blocks a multiprocessor). */
enum : size_t { FP4_XSH_MAX = 76 * 1024 };

/* the two passes through the streaming kernel: x's operands xs [T][fp4_row_u32(D, P)] u32, then
 * act's [rows][fp4_row_u32(I, P)] (the up pass's output), in h's place; P = 3 parts, or 1 in the
 * one-part form */
static int fp4_stream(ds_cu *c, float *h, float *y, const float *x, int T, unsigned ya, int D,
                      int I, int E, int e0, int k, const fp4_w *w, const int32_t *start,
                      const int32_t *perm, const int32_t *active, const int32_t *n_active,
                      const int32_t *direct, moe_act act, ds_err *err) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    /* the activations' first part alone where batch invariance is off and asked (fp4_mma_step) */
    const int one = c->fp4_one && !c->batch_invariant, P = one ? 1 : 3;
    const size_t bu = fp4_row_u32(D, P) * 4, bd = fp4_row_u32(I, P) * 4; /* bytes a row */
    if (bu > FP4_XSH_MAX || bd > FP4_XSH_MAX)
        return ds_errf(err, "cuda: moe mxfp4: widths %d and %d (too wide to stream)", D, I);
    if (!c->moe_fp4_smem) { /* once, before any capture can be open */
        for (int o = 0; o < 2; o++)
            for (int i = 0; i < 4; i++) {
                CU_TRY(cudaFuncSetAttribute((const void *)moe_fp4m_up[o][i],
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)FP4_XSH_MAX),
                       "moe mxfp4: shared memory");
                CU_TRY(cudaFuncSetAttribute((const void *)moe_fp4m_dn[o][i],
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)FP4_XSH_MAX),
                       "moe mxfp4: shared memory");
            }
        c->moe_fp4_smem = 1;
    }
    /* routed rows a pass (the bits do not depend on it) */
    const int nu = DS_MIN(DS_MIN(8, T), (int)(FP4_XSH_MAX / bu));
    const int nd = DS_MIN(DS_MIN(8, T), (int)(FP4_XSH_MAX / bd));
    uint32_t *xs = (uint32_t *)h, *as = xs + (size_t)T * fp4_row_u32(D, P);
    const int su = fp4_splits(I / 8, D), sd = fp4_splits(D / 16, I);
    const int tu = 8 >> su, td = 8 >> sd; /* tiles a block */
    const int words = T * (D / 8);
    launch_k(c, one ? moe_fp4_split_k<1> : moe_fp4_split_k<3>,
             (unsigned)DS_MIN((words + 255) / 256, 4 * c->n_sm), 256, 0, xs, x, D, T);
    launch_k(c, moe_fp4m_up[one][su], dim3((unsigned)((I / 8 + tu - 1) / tu), ya), 256, nu * bu,
             (void *)as, 0, (const uint32_t *)xs, k, w->gc, w->gs, I, D, start, perm, active,
             n_active, act, direct, e0, E, nu);
    CU_TRY(cudaGetLastError(), "moe mxfp4 up");
    launch_k(c, moe_fp4m_dn[one][sd], dim3((unsigned)((D / 16 + td - 1) / td), ya), 256, nd * bd,
             (void *)y, D, (const uint32_t *)as, 1, w->dc, w->ds, D, I, start, perm, active,
             n_active, none, direct, e0, E, nd);
    CU_TRY(cudaGetLastError(), "moe mxfp4 down");
    return DS_OK;
}

extern "C" void ds_cu_set_fp4_one_part(ds_cu *c, int on) {
    c->fp4_one = on;
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
    /* floats: h (the streaming passes' operands, 1.5 u32 an activation, or the BF16 x
     * [rows][D] and act [rows][I]), y [rows][D]; ints: start [E+1], perm [rows], active [E],
     * n [1], hist [n_chunks][E] */
    const size_t hs = (size_t)T * fp4_row_u32(D, 3) + (size_t)rows * fp4_row_u32(I, 3);
    const size_t hf = (DS_MAX(hs, (size_t)rows * (D + I) / 2 + 1) + 3) / 4 * 4;
    const size_t nf = hf + (size_t)rows * D;
    const size_t ni = (size_t)E + 1 + rows + E + 1 + (size_t)n_chunks * E;
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, (nf + ni) * sizeof(float), "moe scratch",
                     err))
        return DS_ERR;
    float *h = c->part, *y = c->part + hf;
    int32_t *start = (int32_t *)(c->part + nf), *perm = start + E + 1, *active = perm + rows;
    int32_t *n_active = active + E, *hist = n_active + 1;
    const int32_t *direct = T == 1 ? idx : NULL;
    const unsigned ya = moe_block_rows(direct != NULL, rows, E);
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
    } else if (fp4_stream(c, h, y, x, T, ya, D, I, E, e0, k, &fw, start, perm, active, n_active,
                          direct, act, err)) {
        return DS_ERR;
    }
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    ds_cu_prof_mark(c, "moe combine");
    moe_combine(c, out, y, w, idx, e0, E, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe mxfp4 combine");
    return DS_OK;
}
