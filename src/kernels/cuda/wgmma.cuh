/* wgmma.cuh — Hopper's warpgroup MMA (wgmma) as the kernels use it: shared-memory matrix
 * descriptors for tiles in the 128-byte swizzle, the BF16 products with A in registers, and the
 * fence. Only for sm_90a code (__CUDA_ARCH_FEAT_SM90_ALL); a kernel built for other targets must
 * not call these (it traps instead, and the host launches it only where ds_cu's wgmma is set:
 * compute capability exactly 9.0, since sm_90a code runs on no later part, which JITs the PTX
 * instead).
 *
 * What the first kernel on it (mla_flash_wg.cu) taught (bench/RESULTS.md session 45):
 * - B tiles must be in the 128-byte swizzle: in plain 128-byte core matrices ("interleaved") the
 *   same products ran at half mma.sync's speed; swizzled, 1.29x it. A tile is blocks of 64 BF16
 *   columns, each [rows][128 bytes], 1024-byte aligned, chunk c of row r at chunk c ^ (r % 8).
 * - ptxas serializes wgmma (warning C7515 / C7518, or injects waits: C7517) when a non-wgmma
 *   instruction writes an accumulator while a wgmma group is open, or when wgmma sits under a
 *   branch it cannot prove uniform: zero no accumulator by hand (write the first k-step with a
 *   write-only form), rescale outputs only after the wait that retires them, and keep wgmma out
 *   of branches on the warpgroup index. Build with -Xptxas -v and read its warnings.
 * - cp.async's writes reach wgmma's reads through fence.proxy.async.shared::cta (each writer,
 *   after its wait) and a barrier. */
#ifndef DS_CUDA_WGMMA_CUH
#define DS_CUDA_WGMMA_CUH

#include "kernels/cuda/common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* where chunk c (16 bytes: 8 BF16 columns) of row r of a 64-row swizzled tile sits, in bytes
 * from the tile's start: blocks of 64 columns [64 rows][128 bytes] (8 KB) one after another */
static __device__ __forceinline__ int wg_swz(int r, int c) {
    return (c >> 3) * 8192 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

/* a shared-memory matrix descriptor: start, leading and stride byte offsets, 128-byte swizzle */
static __device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3ffffu) >> 4) | (uint64_t)(lbo >> 4) << 16 |
           (uint64_t)(sbo >> 4) << 32 | (uint64_t)1 << 62;
}

/* The accumulator operands d [N / 8][4] of an m64nNk16 wgmma, each through K: WG_RW ("+f", read
 * and written) or WG_WO ("=f", written only) */
#define WG_RW(x)    "+f"(x)
#define WG_WO(x)    "=f"(x)
#define WG_D4(K, j) K(d[j][0]), K(d[j][1]), K(d[j][2]), K(d[j][3])
#define WG_D32(K)                                                                                  \
    WG_D4(K, 0), WG_D4(K, 1), WG_D4(K, 2), WG_D4(K, 3), WG_D4(K, 4), WG_D4(K, 5), WG_D4(K, 6),     \
        WG_D4(K, 7)
#define WG_D64(K)                                                                                  \
    WG_D32(K), WG_D4(K, 8), WG_D4(K, 9), WG_D4(K, 10), WG_D4(K, 11), WG_D4(K, 12), WG_D4(K, 13),   \
        WG_D4(K, 14), WG_D4(K, 15)
/* m64n64k16 with B K-major: d %0-%31, A %32-%35, B's descriptor %36, acc %37 (0: d = A B) */
#define WG_N64_ASM                                                                                 \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                   \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "   \
    "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "    \
    "%27, %28, %29, %30, %31}, "                                                                   \
    "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"

/* d (+)= A B for the warpgroup (m64nNk16, BF16, f32 accumulation): A (64 x 16) in registers as
 * four warps' mma.m16n8k16 A fragments, B in shared memory by its descriptor; acc 0 overwrites d
 * (d in four warps' m16n8 C fragments, N / 8 of them). N = 64 with B K-major, N = 128 with B
 * MN-major (transposed). */
static __device__ __forceinline__ void wg_mma_n64(float (&d)[8][4], const uint32_t (&a)[4],
                                                  uint64_t desc, int acc) {
    asm volatile(WG_N64_ASM
                 : WG_D32(WG_RW)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

/* the same with d written, not read (the first k-step, acc 0: d needs no zeroing beforehand,
 * and no instruction but the wgmma defines it, which keeps ptxas from serializing the
 * pipelined form) */
static __device__ __forceinline__ void wg_mma_n64_first(float (&d)[8][4], const uint32_t (&a)[4],
                                                        uint64_t desc, int acc) {
    asm volatile(WG_N64_ASM
                 : WG_D32(WG_WO)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

static __device__ __forceinline__ void wg_mma_n128_tb(float (&d)[16][4], const uint32_t (&a)[4],
                                                      uint64_t desc, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
                 "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, "
                 "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
                 "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : WG_D64(WG_RW)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

static __device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
#endif

#endif
