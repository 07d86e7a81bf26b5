/* jsonutil.h — small helpers over jansson shared by the file parsers (config.json, safetensors
 * headers) and the API's request parser, so their error messages name JSON types the same way. */
#ifndef DS_JSONUTIL_H
#define DS_JSONUTIL_H

#include <jansson.h>

/* "object", "array", "string", "integer", "number", "boolean" or "null". */
const char *ds_json_type_name(const json_t *v);

#endif
