/* draw_exp.h — the draw's exponential, one definition for the CPU sampler (sample/sampler.c) and
 * the GPU's draw kernel (kernels/cuda/sample.cu), so that both weigh a row's logits to the same
 * bits: exp(x) for x <= 0 within a few ulp, 0 below -87 (also -inf and NaN). Every operation is
 * rounded as written: on the device through __fmul_rn and friends (nvcc would otherwise contract
 * a multiply and an add into one FMA), on the host as plain C operations. */
#ifndef DS_DRAW_EXP_H
#define DS_DRAW_EXP_H

#include "kernels/shared/hd.h"

#include <stdint.h>
#include <string.h>

/* c ? a : b. On the host on the bits: a float select that feeds arithmetic is kept as a branch
 * under the default -ftrapping-math, which would stop the sampler's loops from vectorising. */
static inline float ds_dx_pick(int c, float a, float b) {
    uint32_t ua, ub, m = 0u - (uint32_t)c;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    ua = (ua & m) | (ub & ~m);
    memcpy(&a, &ua, 4);
    return a;
}

#ifdef __CUDA_ARCH__
#define DS_DX_MUL(a, b)     __fmul_rn(a, b)
#define DS_DX_ADD(a, b)     __fadd_rn(a, b)
#define DS_DX_SUB(a, b)     __fsub_rn(a, b)
#define DS_DX_PICK(c, a, b) ((c) ? (a) : (b))
#else
#define DS_DX_MUL(a, b)     ((a) * (b))
#define DS_DX_ADD(a, b)     ((a) + (b))
#define DS_DX_SUB(a, b)     ((a) - (b))
#define DS_DX_PICK(c, a, b) ds_dx_pick(c, a, b)
#endif

/* Straight-line code the host compiler vectorises, where libm's expf is one call per element:
 * x = n ln2 + r with |r| <= ln2/2 (ln2 split in a part exact in n * hi and a remainder), e^r by
 * Taylor to r^7 (the next term, 0.35^8 / 8! < 6e-9, is below float precision), 2^n built in the
 * exponent bits. */
static DS_HD_INLINE float ds_exp_nonpos(float x) {
    const int ok = x >= -87.0f;
    const float xc = DS_DX_PICK(ok, x, -87.0f);
    /* 1.5 * 2^23 rounds to integer */
    const float n = DS_DX_SUB(DS_DX_ADD(DS_DX_MUL(xc, 1.44269504f), 12582912.0f), 12582912.0f);
    const float r =
        DS_DX_SUB(DS_DX_SUB(xc, DS_DX_MUL(n, 0.693145751953125f)), DS_DX_MUL(n, 1.42860677e-6f));
    float p = 1.0f / 5040;
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f / 720);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f / 120);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f / 24);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f / 6);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 0.5f);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f);
    p = DS_DX_ADD(DS_DX_MUL(p, r), 1.0f);
    const int32_t e = ((int32_t)n + 127) << 23; /* n in [-126, 0] */
#ifdef __CUDA_ARCH__
    const float scale = __int_as_float(e);
#else
    float scale;
    memcpy(&scale, &e, 4);
#endif
    return DS_DX_PICK(ok, DS_DX_MUL(p, scale), 0.0f);
}

#undef DS_DX_MUL
#undef DS_DX_ADD
#undef DS_DX_SUB
#undef DS_DX_PICK

#endif
