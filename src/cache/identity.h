/* identity.h — what names a model in keys that outlive the process (issue 30, case 3).
 *
 * Offload entries on disk and in Redis are read by later processes, possibly serving another
 * model: a fine-tune of the same shape redeployed on the same folder must never see the old
 * model's pages. So the key names the weights by their contents, not by their config or size. */
#ifndef DS_IDENTITY_H
#define DS_IDENTITY_H

#include "base/ds_base.h"

/* XXH3-128 over config.json and every *.safetensors file of dir, in name order (each file's
 * name, size and bytes). Reads the whole checkpoint once (the loader has usually just brought it
 * into the page cache). out: [2]. */
int ds_checkpoint_digest(const char *dir, uint64_t out[2], ds_err *err);

/* Bytes of dir's *.safetensors files together (0 when none can be read): the whole checkpoint's
 * size, the same on every rank of a job whatever share of it each rank loads. */
uint64_t ds_checkpoint_file_bytes(const char *dir);

#endif
