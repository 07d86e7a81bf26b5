/* registry.c — which backends this build has, and the table of the one a model asks for
 * (model/backend.h). The only file that knows whether the CUDA backend is linked: the build
 * defines DS_HAVE_CUDA for it when it compiles src/backend/cuda (`make cuda`). */
#include "backend/cpu/cpu.h"
#include "model/model.h"
#ifdef DS_HAVE_CUDA
#include "backend/cuda/cuda.h"
#endif

const ds_backend_ops *ds_backend_find(int device, ds_err *err) {
#ifdef DS_HAVE_CUDA
    if (device == DS_DEVICE_CUDA || (device == DS_DEVICE_AUTO && ds_cuda_backend.available()))
        return &ds_cuda_backend;
#else
    if (device == DS_DEVICE_CUDA) {
        ds_errf(err, "device cuda: this build has no CUDA backend (build it with `make cuda`)");
        return NULL;
    }
#endif
    if (device == DS_DEVICE_CPU || device == DS_DEVICE_AUTO) return &ds_cpu_backend;
    ds_errf(err, "device %d: expected cpu, cuda or auto", device);
    return NULL;
}
