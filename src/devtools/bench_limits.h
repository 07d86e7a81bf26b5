/* bench_limits.h — what this machine can do at best, so `bench` can report its results as a
 * fraction of the limit (decode is bound by memory bandwidth, prefill by FMA throughput). */
#ifndef DS_BENCH_LIMITS_H
#define DS_BENCH_LIMITS_H

#include <stddef.h>

/* Read bandwidth in GB/s (1e9 bytes/s) of `threads` OpenMP threads (<= 0: all) streaming through a
 * buffer of `bytes` (make it much larger than the last-level cache; 1 GiB is a good size). Best of
 * several repetitions, AVX2 loads when the CPU has them. Returns a negative value on failure. */
double ds_bench_read_bandwidth(size_t bytes, int threads);

/* Single-precision FMA throughput in GFLOP/s (an FMA counts as 2 flops) of `threads` OpenMP
 * threads (<= 0: all), AVX2+FMA when the CPU has them. Best of several repetitions. */
double ds_bench_fma_peak(int threads);

#endif
