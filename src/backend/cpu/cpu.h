/* cpu.h — the CPU backend: the forward pass on the host's cores, through kernels/cpu (the
 * reference every other backend matches). The backend registry (src/backend/registry.c) hands
 * out its table. */
#ifndef DS_BACKEND_CPU_H
#define DS_BACKEND_CPU_H

#include "model/backend.h"

extern const ds_backend_ops ds_cpu_backend;

#endif
