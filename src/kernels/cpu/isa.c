/* isa.c — which instruction set the kernels use, chosen once per process.
 *
 * The choice is the best path the CPU (and the OS, for the wider register state) supports, unless
 * DS_ISA=scalar|avx2|avx512 asks for another. A request the CPU cannot honour falls back to the
 * best supported path below it: forcing a path must never make a kernel execute an illegal
 * instruction. Every kernel reads the choice through ds_kernels_isa() at its entry, so tests can
 * switch paths between calls with ds_kernels_force_isa(). Callers are single-threaded (kernels.h),
 * which is why the lazy initialisation below needs no lock. */
#include "kernels/cpu/kernels.h"

#include <cpuid.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

static int g_inited;
static ds_isa g_isa = DS_ISA_SCALAR;

/* CPUID.1:ECX.F16C, read directly: clang's __builtin_cpu_supports does not know "f16c". */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

int ds_isa_supported(ds_isa isa) {
    switch (isa) {
    case DS_ISA_SCALAR:
        return 1;
    case DS_ISA_AVX2:
        /* __builtin_cpu_supports also checks that the OS saves the YMM state (XGETBV). The AVX2
         * kernels use FMA and F16C (half -> float) besides AVX2 itself. */
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case DS_ISA_AVX512:
        /* The AVX-512 kernels are compiled for F+BW+VL and use no BF16 instructions, so those three
         * (plus the AVX2 set, which every such CPU has) are what must be present. */
        return ds_isa_supported(DS_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    }
    return 0;
}

const char *ds_isa_name(ds_isa isa) {
    switch (isa) {
    case DS_ISA_SCALAR:
        return "scalar";
    case DS_ISA_AVX2:
        return "avx2";
    case DS_ISA_AVX512:
        return "avx512";
    }
    return "unknown";
}

/* The best supported path at or below `want`. */
static ds_isa clamp_supported(ds_isa want) {
    for (int i = (int)want; i > (int)DS_ISA_SCALAR; i--)
        if (ds_isa_supported((ds_isa)i)) return (ds_isa)i;
    return DS_ISA_SCALAR;
}

void ds_kernels_init(void) {
    if (g_inited) return;
    __builtin_cpu_init();
    ds_isa want = DS_ISA_AVX512;
    const char *env = getenv("DS_ISA");
    if (env && *env) {
        if (!strcasecmp(env, "scalar"))
            want = DS_ISA_SCALAR;
        else if (!strcasecmp(env, "avx2"))
            want = DS_ISA_AVX2;
        else if (!strcasecmp(env, "avx512"))
            want = DS_ISA_AVX512;
        else /* a typo must not silently pick a different path than the user believes */
            fprintf(stderr,
                    "deltaserve: DS_ISA=%s not understood (scalar|avx2|avx512); using auto\n", env);
    }
    g_isa = clamp_supported(want);
    if (env && *env && strcasecmp(env, ds_isa_name(g_isa)) != 0 &&
        (!strcasecmp(env, "avx2") || !strcasecmp(env, "avx512")))
        fprintf(stderr, "deltaserve: DS_ISA=%s not supported by this CPU; using %s\n", env,
                ds_isa_name(g_isa));
    g_inited = 1;
}

ds_isa ds_kernels_isa(void) {
    if (!g_inited) ds_kernels_init();
    return g_isa;
}

void ds_kernels_force_isa(ds_isa isa) {
    ds_kernels_init();
    g_isa = clamp_supported(isa);
}
