/* cmd_tokenize.c — `deltaserve tokenize`: encode text to ids, or decode a comma-separated id list.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "text/tokenizer.h"

/* Parses "1,2, 3" into *ids [*n] (malloc'd). Errors name the offending item. */
static int parse_ids(const char *s, int32_t **ids, int *n, ds_err *err) {
    size_t cap = 1;
    for (const char *p = s; *p; p++) cap += *p == ',';
    int32_t *v = ds_malloc(cap * sizeof *v, err); /* [cap] */
    if (!v) return DS_ERR;
    int k = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        while (*end == ' ') end++;
        if (end == p || (*end != ',' && *end != 0) || errno == ERANGE || x < 0 || x > INT32_MAX) {
            size_t len = strcspn(p, ",");
            free(v);
            return ds_errf(err, "--decode: expected comma-separated token ids, got '%.*s'",
                           (int)len, p);
        }
        v[k++] = (int32_t)x;
        if (*end == 0) break;
        p = end + 1;
    }
    *ids = v;
    *n = k;
    return DS_OK;
}

/* Length of the valid UTF-8 sequence starting at b[0] (of n bytes), or 0 if it is not one. */
static size_t utf8_seq(const unsigned char *b, size_t n) {
    size_t len = b[0] < 0x80         ? 1
                 : (b[0] >> 5) == 6  ? 2
                 : (b[0] >> 4) == 14 ? 3
                 : (b[0] >> 3) == 30 ? 4
                                     : 0;
    if (len == 0 || len > n || (len == 2 && b[0] < 0xc2)) return 0;
    for (size_t i = 1; i < len; i++)
        if ((b[i] & 0xc0) != 0x80) return 0;
    return len;
}

/* Writes a token's bytes: complete UTF-8 characters as they are, control characters, '\\' and
 * bytes of split characters as escapes. */
static void print_token_bytes(const char *bytes, size_t len) {
    const unsigned char *b = (const unsigned char *)bytes;
    for (size_t j = 0; j < len;) {
        size_t k = utf8_seq(b + j, len - j);
        if (k == 1 && b[j] == '\\')
            fputs("\\\\", stdout);
        else if (k > 1 || (k == 1 && b[j] >= 0x20 && b[j] != 0x7f))
            fwrite(b + j, 1, k, stdout);
        else
            printf("\\x%02x", b[j]), k = 1;
        j += k;
    }
}

/* Prints the ids on one line (pasteable into --decode), then one line per token with its bytes. */
static int do_encode(const ds_tokenizer *tok, const char *text, int allow_special) {
    ds_err err = {{0}};
    int32_t *ids = NULL; /* [n] */
    int n = 0;
    if (ds_tok_encode(tok, text, strlen(text), allow_special, &ids, &n, &err) != DS_OK) {
        fprintf(stderr, "deltaserve tokenize: %s\n", err.msg);
        free(ids);
        return 1;
    }
    printf("%d tokens: ", n);
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
    putchar('\n');
    for (int i = 0; i < n; i++) {
        size_t len = 0;
        const char *b = ds_tok_token_bytes(tok, ids[i], &len);
        printf("%d\t", ids[i]);
        if (b) print_token_bytes(b, len);
        putchar('\n');
    }
    free(ids);
    return 0;
}

static int do_decode(const ds_tokenizer *tok, const int32_t *ids, int n, int skip_special) {
    ds_err err = {{0}};
    char *out = NULL; /* [len + 1] */
    size_t len = 0;
    if (ds_tok_decode(tok, ids, n, skip_special, &out, &len, &err) != DS_OK) {
        fprintf(stderr, "deltaserve tokenize: %s\n", err.msg);
        return 1;
    }
    fwrite(out, 1, len, stdout);
    putchar('\n');
    free(out);
    return 0;
}

int ds_cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *decode = NULL;
    int allow_special = 1, skip_special = 0;
    ds_arg opts[] = {
        {"model", "m", DS_ARG_STRING, &model, "DIR", "folder with tiktoken.model", .required = 1},
        DS_OPT("text", "t", DS_ARG_STRING, &text, "TEXT",
               "text to encode; prints one id per token"),
        DS_OPT("decode", "d", DS_ARG_STRING, &decode, "IDS",
               "comma-separated ids to decode, e.g. 1,2,3"),
        DS_OPT("allow-special", NULL, DS_ARG_BOOL, &allow_special, NULL,
               "encode special-token strings as their ids"),
        DS_OPT("skip-special", NULL, DS_ARG_BOOL, &skip_special, NULL,
               "leave special tokens out of decoded text"),
    };
    ds_args a = {
        "deltaserve tokenize",
        "Encode --text into token ids (listed with each token's bytes) and/or decode --decode.",
        opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    if (!text && !decode) {
        fprintf(stderr, "deltaserve tokenize: give --text, --decode or both\n");
        return 2;
    }

    ds_err err = {{0}};
    int32_t *ids = NULL; /* [n] ids given to --decode */
    int n = 0;
    if (decode && parse_ids(decode, &ids, &n, &err) != DS_OK) {
        fprintf(stderr, "deltaserve tokenize: %s\n", err.msg);
        return 2;
    }
    ds_tokenizer *tok = NULL;
    if (ds_tok_load(model, &tok, &err) != DS_OK) {
        fprintf(stderr, "deltaserve tokenize: %s\n", err.msg);
        free(ids);
        return 1;
    }
    rc = 0;
    if (text) rc = do_encode(tok, text, allow_special);
    if (decode && rc == 0) rc = do_decode(tok, ids, n, skip_special);
    free(ids);
    ds_tok_free(tok);
    return rc;
}
