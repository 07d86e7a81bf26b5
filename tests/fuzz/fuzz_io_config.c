/* fuzz_io_config.c — libFuzzer target for config.json parsing (src/io/config.c): every input
 * goes through both ds_config_parse (kimi_linear / kimi_k3) and ds_draft_config_parse (k3_dspark).
 * A parse either fails with a message or gives a config whose layer schedule fits its arrays. */
#include <stdlib.h>

#include "fuzzutil.h"
#include "io/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *json = fz_strndup(data, size);
    ds_config cfg;
    ds_err err;
    err.msg[0] = 0;
    int rc = ds_config_parse(json, "fuzz", &cfg, &err);
    fz_note("config", rc, err.msg);
    if (rc == DS_OK) {
        if (cfg.num_hidden_layers < 0 || cfg.num_hidden_layers > DS_MAX_LAYERS)
            fz_fail("num_hidden_layers %d outside 0..%d", cfg.num_hidden_layers, DS_MAX_LAYERS);
        int n_kda = 0, n_mla = 0, n_moe = 0;
        for (int l = 0; l < cfg.num_hidden_layers; l++) {
            n_kda += cfg.layer_kind[l] == DS_LAYER_KDA;
            n_mla += cfg.layer_kind[l] == DS_LAYER_MLA;
            n_moe += ds_config_layer_is_moe(&cfg, l) != 0;
        }
        if (n_kda != cfg.num_kda_layers || n_mla != cfg.num_mla_layers)
            fz_fail("layer counts %d/%d disagree with the schedule %d/%d", cfg.num_kda_layers,
                    cfg.num_mla_layers, n_kda, n_mla);
        if (n_moe && cfg.num_experts <= 0) fz_fail("MoE layers without experts");
    } else if (!err.msg[0]) {
        fz_fail("ds_config_parse failed without a message");
    }
    ds_draft_config d;
    err.msg[0] = 0;
    rc = ds_draft_config_parse(json, "fuzz", &d, &err);
    fz_note("draft", rc, err.msg);
    if (rc == DS_OK) {
        if (d.num_target_layers < 0 || d.num_target_layers > DS_MAX_TAPS)
            fz_fail("num_target_layers %d outside 0..%d", d.num_target_layers, DS_MAX_TAPS);
    } else if (!err.msg[0]) {
        fz_fail("ds_draft_config_parse failed without a message");
    }
    free(json);
    return 0;
}
