/* tp.c — see tp.h. */
#include "parallel/tp.h"
#include "model/model.h"

#include <stdio.h>

int ds_tp_mla_padded_heads(int heads_per_rank) {
    if (heads_per_rank <= 0) return 0;
    static const int widths[] = {16, 32, 64, 128};
    for (size_t i = 0; i < DS_ARRAY_LEN(widths); i++)
        if (heads_per_rank <= widths[i]) return widths[i];
    return (heads_per_rank + 127) / 128 * 128;
}

int ds_tp_check_dir(const char *model_dir, int T, ds_err *err) {
    char path[4096];
    ds_config c;
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    if (ds_config_load(path, &c, err)) return DS_ERR;
    return ds_model_tp_check(&c, T, err);
}
