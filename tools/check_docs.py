#!/usr/bin/env python3
"""check_docs.py — every reference to the project's docs resolves, and the docs name only what exists.

Scans src/, tests/, tools/, README.md and docs/ for:
  1. `docs/<name>.md`: the file exists;
  2. `docs/<name>.md §x.y` (also lists: `§1, §2`, `§2–§7`, `§9.2 / §12`): that file has a heading
     `§x.y ...` (docs/model.md numbers its headings so that citations survive edits);
  3. `docs/<name>.md invariant N`: that file has an "Invariants" heading with an item `N.` below it;
  4. `docs/<name>.md, "Heading"`: that file has a heading containing the quoted words;
  5. relative markdown links in README.md and docs/*.md: the target exists.
And for README.md and every docs/*.md:
  6. every repo path it names (a backquoted `src/...`, `tests/...`, `tools/...`, `docs/...`,
     `models/...`, `configs/...`, `eval/...`, `bench/...`, a link, the first word of a line in a
     code block) exists as a file or folder; a trailing `/` is allowed, and a pattern (a name
     holding `<`, `*` or `{`, such as `test_cuda_<op>.c`) is skipped;
  7. every `--flag` it names is a flag some command parses: a quoted "flag" or "--flag" in the C
     sources (src/, tests/) or in the Python drivers (bench/, eval/, tools/); flags of other
     programs the docs show being run are listed in FOREIGN_FLAGS;
  8. README.md is at most 6,000 bytes;
  9. docs/architecture.md's include table ("| folder | may include |") is tools/check_layout.py's
     LAYERS, row for row.

Prints every breach and exits 1 if there is one. Usage: tools/check_docs.py [repo root] (the
root defaults to this file's parent folder, so it runs from any cwd; ctest: check_docs)."""
import os
import re
import sys

SCAN = ["src", "tests", "tools", "README.md", "docs"]
TEXT_EXT = (".c", ".h", ".cu", ".cuh", ".py", ".sh", ".md", ".txt", ".cmake", ".sed", ".json",
            ".toml", ".cfg", ".yaml", ".yml")
README_MAX = 6000
PATH_PREFIX = r"(?:src|tools|docs|tests|models|configs|eval|bench)/"
SEP = r"(?:\s*(?:,|/|–|—|-|and|or|to)?\s*)"
SECTION_LIST = re.compile(r"docs/([\w.-]+\.md)`?((?:" + SEP + r"§\d+(?:\.\d+)*)+)")
DOC_REF = re.compile(r"docs/([\w.-]+\.md)")
INVARIANT_REF = re.compile(r"docs/([\w.-]+\.md)`?,?\s+invariants?\s+(\d+)")
QUOTED_REF = re.compile(r"docs/([\w.-]+\.md)`?,\s*\"([^\"]+)\"")
# Flags of programs that are not ours, named where the docs show them being run; every other
# `--flag` in README.md and docs/ must be parsed by deltaserve or one of the repo's own scripts.
# (mpirun's --oversubscribe, --bind-to, --allow-run-as-root need no entry: src/transport passes them.)
FOREIGN_FLAGS = {
    "hostfile",                 # mpirun across hosts (docs/parallelism.md)
    "tasks", "include_path",    # lm_eval, the eval through lm-eval-harness (eval/README.md)
    "vllm-pd-disaggregation", "prefill", "decode",  # vllm-router in P/D mode (docs/pd.md)
}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(path, cache={}):
    """[(level, text, line index)] of a markdown file's headings, outside fenced blocks."""
    if path not in cache:
        out, fenced = [], False
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        for i, l in enumerate(lines):
            if l.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(l)
            if m:
                out.append((len(m.group(1)), m.group(2), i))
        cache[path] = (out, lines)
    return cache[path]


def sections(path):
    return {m.group(1) for _, t, _ in headings(path)[0] for m in [re.match(r"§(\d+(?:\.\d+)*)", t)]
            if m}


def has_invariant(path, n):
    hs, lines = headings(path)
    for lvl, text, i in hs:
        if "nvariant" not in text:
            continue
        end = next((j for l2, _, j in hs if j > i and l2 <= lvl), len(lines))
        if any(re.match(r"\s*%d\.\s" % n, l) for l in lines[i + 1:end]):
            return True
    return False


def files_to_scan(root):
    for top in SCAN:
        p = os.path.join(root, top)
        if os.path.isfile(p):
            yield p
            continue
        for dp, dns, fs in os.walk(p):
            dns[:] = [d for d in dns if not d.startswith(".") and d != "corpus"]
            for f in sorted(fs):
                if f.endswith(TEXT_EXT) or f in ("CMakeLists.txt", "Makefile"):
                    yield os.path.join(dp, f)


def check_refs(root, path, text, bad):
    rel = os.path.relpath(path, root)
    docs = os.path.join(root, "docs")

    def where(pos):
        return f"{rel}:{text.count(chr(10), 0, pos) + 1}"

    for m in DOC_REF.finditer(text):
        if not os.path.isfile(os.path.join(docs, m.group(1))):
            bad.append(f"{where(m.start())}: docs/{m.group(1)} does not exist")
    for m in SECTION_LIST.finditer(text):
        f = os.path.join(docs, m.group(1))
        if not os.path.isfile(f):
            continue
        have = sections(f)
        for s in re.findall(r"§(\d+(?:\.\d+)*)", m.group(2)):
            if s not in have:
                bad.append(f"{where(m.start())}: docs/{m.group(1)} has no heading §{s}")
    for m in INVARIANT_REF.finditer(text):
        f = os.path.join(docs, m.group(1))
        if os.path.isfile(f) and not has_invariant(f, int(m.group(2))):
            bad.append(f"{where(m.start())}: docs/{m.group(1)} lists no invariant {m.group(2)}")
    for m in QUOTED_REF.finditer(text):
        f = os.path.join(docs, m.group(1))
        want = m.group(2).lower()
        if os.path.isfile(f) and not any(want in t.lower() for _, t, _ in headings(f)[0]):
            bad.append(f"{where(m.start())}: docs/{m.group(1)} has no heading \"{m.group(2)}\"")
    if path.endswith(".md") and (rel == "README.md" or rel.startswith("docs" + os.sep)):
        for m in LINK.finditer(text):
            t = m.group(1).split("#")[0]
            if not t or re.match(r"[a-z]+:", t):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), t))):
                bad.append(f"{where(m.start())}: link to {m.group(1)}, which does not exist")


def doc_paths(text):
    """(line, path) for the repo paths a markdown page names: words of backquoted spans, link
    targets and the first word of code-block lines that start with a repo folder."""
    out, fenced = [], False
    for ln, l in enumerate(text.split("\n"), 1):
        if l.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            words = l.split()
            if words and re.match(PATH_PREFIX, words[0]):
                out.append((ln, words[0]))
            continue
        for span in re.findall(r"`([^`]+)`", l):
            for w in span.split():
                if re.match(PATH_PREFIX, w):
                    out.append((ln, w))
    return out


def parsed_flags(root, cache={}):
    """Every quoted lowercase word in the C sources and every quoted "--flag" in the Python
    drivers: a superset of the flags the repo's commands parse."""
    if root not in cache:
        parsed = set()
        for top, ext, pat in (("src", (".c", ".h"), r"\"(?:--)?([a-z][a-z0-9-]+)\""),
                              ("tests", (".c", ".h", ".cu"), r"\"(?:--)?([a-z][a-z0-9-]+)\""),
                              ("bench", (".py",), r"[\"']--([a-z][a-z0-9_-]+)[\"']"),
                              ("eval", (".py",), r"[\"']--([a-z][a-z0-9_-]+)[\"']"),
                              ("tools", (".py",), r"[\"']--([a-z][a-z0-9_-]+)[\"']")):
            for dp, dns, fs in os.walk(os.path.join(root, top)):
                dns[:] = [d for d in dns if not d.startswith(".") and d != "corpus"]
                for f in fs:
                    if f.endswith(ext):
                        with open(os.path.join(dp, f), encoding="utf-8", errors="replace") as fh:
                            parsed |= set(re.findall(pat, fh.read()))
        cache[root] = parsed
    return cache[root]


def made_by_make(root, w):
    """A path the Makefile writes (`MODEL ?= models/tiny-k3`, `init-model --out models/...`):
    absent from a fresh clone until make runs, so it counts as existing."""
    try:
        with open(os.path.join(root, "Makefile"), encoding="utf-8") as fh:
            made = set(re.findall(r"(models/[\w.-]+)", fh.read()))
    except OSError:
        return False
    return w.rstrip("/") in made or any(w.startswith(m + "/") for m in made)


def check_page(root, rel, text, bad):
    """Rules 6 and 7 for one markdown page (README.md or docs/*.md)."""
    for ln, w in doc_paths(text):
        w = re.split(r"::|:\d", w)[0].rstrip(".,;:)'\"")
        if any(c in w for c in "<*{") or "..." in w or "…" in w:
            continue
        if not os.path.exists(os.path.join(root, w)) and not made_by_make(root, w):
            bad.append(f"{rel}:{ln}: names {w}, which does not exist")
    parsed = parsed_flags(root) | FOREIGN_FLAGS
    for ln, l in enumerate(text.split("\n"), 1):
        for flag in re.findall(r"(?<![\w-])--([a-z][a-z0-9_-]*[a-z0-9])", l):
            name = flag[3:] if flag.startswith("no-") else flag
            if flag != "help" and flag not in parsed and name not in parsed:
                bad.append(f"{rel}:{ln}: names --{flag}, which no command parses")


def check_pages(root, bad):
    p = os.path.join(root, "README.md")
    size = os.path.getsize(p)
    if size > README_MAX:
        bad.append(f"README.md: {size} bytes (> {README_MAX}); move detail into docs/")
    pages = ["README.md"] + sorted(os.path.join("docs", f)
                                   for f in os.listdir(os.path.join(root, "docs"))
                                   if f.endswith(".md"))
    for rel in pages:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            check_page(root, rel, f.read(), bad)


def check_layers(root, bad):
    """Rule 9: the include table of docs/architecture.md equals check_layout.py's LAYERS."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "check_layout", os.path.join(root, "tools", "check_layout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = os.path.join(root, "docs", "architecture.md")
    rows, in_table = {}, False
    with open(page, encoding="utf-8") as f:
        for l in f:
            cells = [c.strip() for c in l.strip().strip("|").split("|")]
            if cells[:2] == ["folder", "may include"]:
                in_table = True
                continue
            if in_table and l.startswith("|"):
                if set(cells[0]) <= set("-: "):
                    continue
                rows[cells[0]] = [] if cells[1] in ("—", "-", "") else \
                    [c.strip() for c in cells[1].split(",")]
            elif in_table:
                break
    if not rows:
        bad.append("docs/architecture.md: no '| folder | may include |' table")
        return
    for k, v in mod.LAYERS.items():
        if k not in rows:
            bad.append(f"docs/architecture.md: the include table has no row for {k} (LAYERS has)")
        elif rows[k] != list(v):
            bad.append(f"docs/architecture.md: {k} may include {', '.join(v) or '—'} "
                       f"(LAYERS), the table says {', '.join(rows[k]) or '—'}")
    for k in rows:
        if k not in mod.LAYERS:
            bad.append(f"docs/architecture.md: the include table's {k} is not in LAYERS")


def main(root):
    bad = []
    for path in files_to_scan(root):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            bad.append(f"{path}: {e}")
            continue
        check_refs(root, path, text, bad)
    check_pages(root, bad)
    check_layers(root, bad)
    for b in bad:
        print(b)
    if bad:
        print(f"check_docs: {len(bad)} breach(es)")
        return 1
    print("check_docs: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
