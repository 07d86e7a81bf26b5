/* test_text_toolparse.c — the reasoning / content / tool-call splitter: results written by hand
 * for whole texts, then the same texts cut at every byte, byte by byte, and in random pieces
 * (fixed seeds) must reassemble to exactly the whole-text result. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "text/toolparse.h"

#define SB "<|tool_calls_section_begin|>"
#define SE "<|tool_calls_section_end|>"
#define CB "<|tool_call_begin|>"
#define AB "<|tool_call_argument_begin|>"
#define CE "<|tool_call_end|>"

/* Everything one parse produced, reassembled: calls as "id|name|args\n" lines. */
typedef struct {
    char content[4096], reasoning[4096], calls[4096];
    int n_calls;
} result;

static void collect(ds_tp_out *o, result *r) {
    strncat(r->content, o->content ? o->content : "", sizeof r->content - strlen(r->content) - 1);
    strncat(r->reasoning, o->reasoning ? o->reasoning : "",
            sizeof r->reasoning - strlen(r->reasoning) - 1);
    for (int i = 0; i < o->n_calls; i++) {
        char line[1024];
        snprintf(line, sizeof line, "%s|%s|%.*s\n", o->calls[i].id, o->calls[i].name,
                 (int)o->calls[i].args_len, o->calls[i].args);
        strncat(r->calls, line, sizeof r->calls - strlen(r->calls) - 1);
    }
    r->n_calls += o->n_calls;
    ds_tp_out_clear(o);
}

/* Parses text cut at the offsets cuts[0..n_cuts) (ascending), clearing the output after every
 * piece as a stream does. */
static void parse_cut(const char *text, ds_tp_opts o, const size_t *cuts, int n_cuts, result *r) {
    memset(r, 0, sizeof *r);
    ds_toolparse p;
    ds_tp_out out = {0};
    ds_err err = {{0}};
    ds_tp_init(&p, &o);
    size_t at = 0, n = strlen(text);
    for (int i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : n;
        assert_int_equal(ds_tp_feed(&p, text + at, end - at, &out, &err), DS_OK);
        collect(&out, r);
        at = end;
    }
    assert_int_equal(ds_tp_finish(&p, &out, &err), DS_OK);
    collect(&out, r);
    ds_tp_out_free(&out);
    ds_tp_free(&p);
}

static void parse_whole(const char *text, ds_tp_opts o, result *r) {
    parse_cut(text, o, NULL, 0, r);
}

static void assert_same(const result *a, const result *b, const char *how) {
    if (strcmp(a->content, b->content) || strcmp(a->reasoning, b->reasoning) ||
        strcmp(a->calls, b->calls) || a->n_calls != b->n_calls)
        fail_msg("%s: content [%s] vs [%s], reasoning [%s] vs [%s], calls [%s] vs [%s]", how,
                 a->content, b->content, a->reasoning, b->reasoning, a->calls, b->calls);
}

/* The whole-text result, then every cut: each single cut, byte by byte, 200 random cuttings. */
static void check(const char *text, ds_tp_opts o, const char *content, const char *reasoning,
                  const char *calls) {
    result whole, r;
    parse_whole(text, o, &whole);
    assert_string_equal(whole.content, content);
    assert_string_equal(whole.reasoning, reasoning);
    assert_string_equal(whole.calls, calls);
    size_t n = strlen(text);
    for (size_t k = 1; k < n; k++) {
        parse_cut(text, o, &k, 1, &r);
        char how[64];
        snprintf(how, sizeof how, "cut at %zu", k);
        assert_same(&r, &whole, how);
    }
    size_t *cuts = malloc((n + 1) * sizeof *cuts); /* [n] */
    for (size_t k = 0; k + 1 < n; k++) cuts[k] = k + 1;
    parse_cut(text, o, cuts, n > 1 ? (int)n - 1 : 0, &r);
    assert_same(&r, &whole, "byte by byte");
    for (unsigned seed = 1; seed <= 200; seed++) {
        srand(seed);
        int nc = 0;
        for (size_t at = 0;;) {
            at += 1 + (size_t)rand() % 9;
            if (at >= n) break;
            cuts[nc++] = at;
        }
        parse_cut(text, o, cuts, nc, &r);
        char how[64];
        snprintf(how, sizeof how, "random cuts, seed %u", seed);
        assert_same(&r, &whole, how);
    }
    free(cuts);
}

static const ds_tp_opts TOOLS = {1, 0, 0}, THINK = {0, 1, 0}, K3 = {0, 1, 1}, ALL = {1, 1, 0},
                        K3T = {1, 1, 1};

/* K3 XTML pieces, with the special tokens' names as the server feeds them */
#define XO                 "<|open|>"
#define XC                 "<|close|>"
#define XS                 "<|sep|>"
#define XCALL(name, i)     XO "call tool=\"" name "\" index=\"" i "\"" XS
#define XARG(key, type, v) XO "argument key=\"" key "\" type=\"" type "\"" XS v XC "argument" XS

static void test_plain_text_unchanged(void **state) {
    (void)state;
    check("Hello <b>world</b> <|im_end|> < <| x", TOOLS, "Hello <b>world</b> <|im_end|> < <| x", "",
          "");
    /* without tools the markers are text */
    ds_tp_opts none = {0, 0, 0};
    check("a" SB CB "functions.f:0" AB "{}" CE SE, none, "a" SB CB "functions.f:0" AB "{}" CE SE,
          "", "");
}

static void test_one_call(void **state) {
    (void)state;
    check("Let me look." SB CB "functions.get_weather:0" AB "{\"city\": \"Paris\"}" CE SE, TOOLS,
          "Let me look.", "", "functions.get_weather:0|get_weather|{\"city\": \"Paris\"}\n");
}

static void test_several_calls(void **state) {
    (void)state;
    check(SB " " CB " functions.a:0 " AB "{\"x\":1}" CE "\n" CB "functions.b.c:1" AB
             "{\"y\":[1,{\"z\":\"}\"}]}" CE CB "functions.a:2" AB "{}" CE "\n" SE,
          TOOLS, "", "",
          "functions.a:0|a|{\"x\":1}\nfunctions.b.c:1|b.c|{\"y\":[1,{\"z\":\"}\"}]}\n"
          "functions.a:2|a|{}\n");
}

static void test_nested_arguments(void **state) {
    (void)state;
    /* braces, quotes, escapes, a '<' and unicode inside the arguments pass through verbatim */
    check(
        SB CB
        "functions.run:0" AB
        "{\"code\": \"if (a<b) { return \\\"}\\\"; }\", \"o\": {\"p\": [{}, {\"q\": \"é中\"}]}}" CE
            SE "after",
        TOOLS, "after", "",
        "functions.run:0|run|{\"code\": \"if (a<b) { return \\\"}\\\"; }\", \"o\": {\"p\": [{}, "
        "{\"q\": \"é中\"}]}}\n");
}

static void test_id_without_prefix_or_index(void **state) {
    (void)state;
    check(SB CB "search" AB "{}" CE CB "functions.x:y" AB "[]" CE SE, TOOLS, "", "",
          "search|search|{}\nfunctions.x:y|x:y|[]\n");
}

static void test_malformed_is_text(void **state) {
    (void)state;
    /* text between calls: the section from there on is content, the parsed call stays */
    check("a" SB CB "functions.f:0" AB "{}" CE "oops" CB "functions.g:1" AB "{}" CE SE, TOOLS,
          "aoops" CB "functions.g:1" AB "{}" CE SE, "", "functions.f:0|f|{}\n");
    /* an id with no name */
    check(SB CB "functions.:0" AB "{}" CE SE "x", TOOLS, SB CB "functions.:0" AB "{}" CE SE "x", "",
          "");
    /* a call that begins inside another's arguments */
    check(SB CB "functions.f:0" AB "{\"a\":" CB "functions.g:1" AB "{}" CE SE, TOOLS,
          SB CB "functions.f:0" AB "{\"a\":" CB "functions.g:1" AB "{}" CE SE, "", "");
    /* a section with no call */
    check("a" SB "\n" SE "b", TOOLS, "a" SB "\n" SE "b", "", "");
    /* an id past 512 bytes */
    char big[700], want[700];
    memset(big, 0, sizeof big);
    strcpy(big, SB CB);
    memset(big + strlen(big), 'n', 520);
    strcat(big, AB "{}" CE SE);
    strcpy(want, big);
    check(big, TOOLS, want, "", "");
    /* an end before the arguments */
    check(SB CB "functions.f:0" CE "t", TOOLS, SB CB "functions.f:0" CE "t", "", "");
}

static void test_unterminated(void **state) {
    (void)state;
    /* a call that never closes comes back as text, byte for byte */
    check("x" SB CB "functions.f:0" AB "{\"a\": 1", TOOLS, "x" SB CB "functions.f:0" AB "{\"a\": 1",
          "", "");
    /* a section that never closes keeps its parsed calls */
    check(SB CB "functions.f:0" AB "{}" CE, TOOLS, "", "", "functions.f:0|f|{}\n");
    /* a marker cut short by the end of the text is text */
    check("hi <|tool_calls_sec", TOOLS, "hi <|tool_calls_sec", "", "");
    check(SB CB "functions.f:0" AB "{}<|tool_ca", TOOLS, SB CB "functions.f:0" AB "{}<|tool_ca", "",
          "");
}

static void test_reasoning(void **state) {
    (void)state;
    check("<think>Let me think.</think>The answer is 4.", THINK, "The answer is 4.",
          "Let me think.", "");
    check("plan first</think>\n\nfour", THINK, "\n\nfour", "plan first", "");
    /* no end tag (a length finish): all of it is reasoning */
    check("still thinking <|tool", THINK, "", "still thinking <|tool", "");
    /* a later <think> is text */
    check("a <think> b</think>c<think>", THINK, "c<think>", "a <think> b", "");
    /* thought, then content, then calls */
    check("need weather</think>Checking." SB CB "functions.w:0" AB "{}" CE SE, ALL, "Checking.",
          "need weather", "functions.w:0|w|{}\n");
    /* tool markers inside the thought are the thought's text */
    check("maybe " SB "</think>ok", ALL, "ok", "maybe " SB, "");
}

static void test_reasoning_k3(void **state) {
    (void)state;
    /* K3's XTML with the special tokens' names in the text */
    check("thought<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>"
          "<|close|>message<|sep|><|end_of_msg|>",
          K3, "answer", "thought", "");
    /* other XTML tags lose their markers, keep their names (as skip_special_tokens does) */
    check("t<|close|>think<|sep|><|open|>response<|sep|>a<|close|>response<|sep|><|open|>tools"
          "<|sep|>",
          K3, "atools", "t", "");
    check("never closed <|close|>thi", K3, "", "never closed thi", "");
}

static void test_k3_calls(void **state) {
    (void)state;
    /* thought, answer, two calls: arguments of every type back as one JSON object */
    check("why" XC "think" XS XO "response" XS "Sure." XC "response" XS XO "tools" XS
          "\n" XCALL("get_weather", "1") XARG("city", "string", "Pa\"ris\n\\")
              XARG("days", "number", " 3 ") XARG("opts", "object", "{\"a\": [1, {\"b\": \"}\"}]}")
                  XARG("ok", "boolean", "true") XC "call" XS XCALL("a&amp;b", "2") XC
          "call" XS XC "tools" XS XC "message" XS "<|end_of_msg|>",
          K3T, "Sure.", "why",
          "functions.get_weather:0|get_weather|{\"city\": \"Pa\\\"ris\\n\\\\\", \"days\": 3, "
          "\"opts\": {\"a\": [1, {\"b\": \"}\"}]}, \"ok\": true}\n"
          "functions.a&b:1|a&b|{}\n");
    /* arguments that did not parse as a raw json block */
    check(XC "think" XS XO "tools" XS XCALL("f", "1") XO "json type=\"object\"" XS "{not json" XC
                                                         "json" XS XC "call" XS XC "tools" XS,
          K3T, "", "", "functions.f:0|f|{not json\n");
    /* malformed: text inside tools, a call without a tool name, a call that never closes */
    /* (the text after the failure is read as content again: its lone markers go) */
    check(XC "think" XS XO "tools" XS "oops" XC "tools" XS, K3T, XO "tools" XS "oopstools", "", "");
    check(XC "think" XS XO "tools" XS XO "call index=\"1\"" XS XC "call" XS, K3T,
          XO "tools" XS XO "call index=\"1\"" XS "call", "", "");
    check(XC "think" XS XO "tools" XS XCALL("f", "1") XO "argument key=\"x\" type=\"string\"" XS
                                                         "abc",
          K3T, XO "tools" XS XCALL("f", "1") XO "argument key=\"x\" type=\"string\"" XS "abc", "",
          "");
    /* without tools the tools element is text, its markers dropped */
    check(XC "think" XS XO "tools" XS XCALL("f", "1") XC "call" XS, K3,
          "toolscall tool=\"f\" index=\"1\"call", "", "");
}

/* Random texts built from markers, pieces of markers and text (fixed seeds): in every mode any
 * cutting gives the whole-text result, and with tools only, when no call parsed, the content is
 * the input byte for byte (nothing dropped, nothing added). */
static void test_random_texts(void **state) {
    (void)state;
    static const char *const parts[] = {SB,
                                        SE,
                                        CB,
                                        AB,
                                        CE,
                                        "functions.f:0",
                                        "functions.g:12",
                                        "{\"a\": \"<|\"}",
                                        " ",
                                        "\n",
                                        "x",
                                        "<|",
                                        "|>",
                                        "<|tool_call",
                                        "</think>",
                                        "<think>",
                                        "<|open|>",
                                        "<|close|>",
                                        "<|sep|>",
                                        "think",
                                        "tools",
                                        "call tool=\"h\"",
                                        "argument key=\"k\" type=\"number\"",
                                        "1",
                                        "json",
                                        "response",
                                        "message",
                                        "<|end_of_msg|>",
                                        "é",
                                        "\"",
                                        "&quot;"};
    const ds_tp_opts modes[] = {TOOLS, THINK, K3, ALL, K3T};
    char text[1200];
    for (unsigned seed = 1; seed <= 300; seed++) {
        srand(seed * 7919u);
        text[0] = 0;
        int n = 1 + rand() % 40;
        for (int i = 0; i < n; i++) {
            const char *p = parts[(size_t)rand() % DS_ARRAY_LEN(parts)];
            if (strlen(text) + strlen(p) < sizeof text) strcat(text, p);
        }
        for (size_t m = 0; m < DS_ARRAY_LEN(modes); m++) {
            result whole, r;
            parse_whole(text, modes[m], &whole);
            if (m == 0 && whole.n_calls == 0) assert_string_equal(whole.content, text);
            size_t len = strlen(text), cuts[64];
            for (int rep = 0; rep < 4; rep++) {
                int nc = 0;
                for (size_t at = 0; nc < 64;) {
                    at += 1 + (size_t)rand() % 12;
                    if (at >= len) break;
                    cuts[nc++] = at;
                }
                parse_cut(text, modes[m], cuts, nc, &r);
                assert_same(&r, &whole, text);
            }
        }
    }
}

/* The special tokens the parser reads, and only those: a thinking model's <think> tokens are
 * among them (a skipped one must still end the thought), a media or reserved one is not. */
static void test_markers(void **state) {
    (void)state;
    static const char *const yes[] = {"<|open|>",
                                      "<|close|>",
                                      "<|sep|>",
                                      "<|end_of_msg|>",
                                      "<|tool_calls_section_begin|>",
                                      "<|tool_call_end|>",
                                      "<think>",
                                      "</think>"};
    static const char *const no[] = {"<|media_pad|>", "[EOT]", "<|open|", "<|reserved_token_7|>",
                                     "think"};
    for (size_t i = 0; i < DS_ARRAY_LEN(yes); i++)
        assert_true(ds_tp_is_marker(yes[i], strlen(yes[i])));
    for (size_t i = 0; i < DS_ARRAY_LEN(no); i++)
        assert_false(ds_tp_is_marker(no[i], strlen(no[i])));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_text_unchanged),
        cmocka_unit_test(test_one_call),
        cmocka_unit_test(test_several_calls),
        cmocka_unit_test(test_nested_arguments),
        cmocka_unit_test(test_id_without_prefix_or_index),
        cmocka_unit_test(test_malformed_is_text),
        cmocka_unit_test(test_unterminated),
        cmocka_unit_test(test_reasoning),
        cmocka_unit_test(test_reasoning_k3),
        cmocka_unit_test(test_k3_calls),
        cmocka_unit_test(test_random_texts),
        cmocka_unit_test(test_markers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
