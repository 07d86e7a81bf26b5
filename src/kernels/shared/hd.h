/* hd.h — DS_HD marks a function of kernels/shared that both the host (C) and the device (CUDA)
 * compile: the one definition of a piece of math that the CPU and GPU must compute bit for bit
 * alike. */
#ifndef DS_HD_H
#define DS_HD_H

#ifdef __CUDACC__
#define DS_HD        __host__ __device__
#define DS_HD_INLINE __host__ __device__ __forceinline__ /* inlined on the device */
#else
#define DS_HD
#define DS_HD_INLINE inline
#endif

#endif
