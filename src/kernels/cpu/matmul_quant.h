/* matmul_quant.h — ds_matmul of quantized weights (FP8 E4M3 ptpc, MXFP4), inside kernels/cpu:
 * ds_matmul hands such matrices here. */
#ifndef DS_MATMUL_QUANT_H
#define DS_MATMUL_QUANT_H

#include "kernels/cpu/kernels.h"

/* y = x W^T for w->dtype DS_DT_F8_E4M3 or DS_DT_MXFP4, as kernels.h defines the product. */
void ds_matmul_quant(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w);

#endif
