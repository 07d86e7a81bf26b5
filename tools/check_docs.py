#!/usr/bin/env python3
"""check_docs.py — every reference to the project's docs resolves, and the README stays a front door.

Scans src/, tests/, tools/, README.md and docs/ for:
  1. `docs/<name>.md`: the file exists;
  2. `docs/<name>.md §x.y` (also lists: `§1, §2`, `§2–§7`, `§9.2 / §12`): that file has a heading
     `§x.y ...` (docs/model.md numbers its headings so that citations survive edits);
  3. `docs/<name>.md invariant N`: that file has an "Invariants" heading with an item `N.` below it;
  4. `docs/<name>.md, "Heading"`: that file has a heading containing the quoted words;
  5. relative markdown links in README.md and docs/*.md: the target exists.
And for README.md: at most 6,000 bytes; every repo path it names (a backquoted `src/...`,
`tools/...`, `docs/...`, `tests/...`, `models/...`, `configs/...`, `eval/...`, `bench/...`, a link,
the first word of a line in a code block) exists; every `--flag` it names is a flag some command
parses (a quoted "flag" or "--flag" in src/ or tests/cachefuzz/).

Prints every breach and exits 1 if there is one. Usage: tools/check_docs.py [repo root]."""
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


def readme_paths(text):
    """Repo paths README.md names: backquoted spans, the first word of code-block lines."""
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
            w = span.split()[0] if span.split() else ""
            if re.match(PATH_PREFIX, w):
                out.append((ln, w))
    return out


def check_readme(root, bad):
    p = os.path.join(root, "README.md")
    size = os.path.getsize(p)
    if size > README_MAX:
        bad.append(f"README.md: {size} bytes (> {README_MAX}); move detail into docs/")
    with open(p, encoding="utf-8") as f:
        text = f.read()
    for ln, w in readme_paths(text):
        w = re.split(r"::", w)[0].rstrip(".,;:)")
        if not os.path.exists(os.path.join(root, w)):
            bad.append(f"README.md:{ln}: names {w}, which does not exist")
    parsed = set()
    for top in ("src", os.path.join("tests", "cachefuzz")):
        for dp, _, fs in os.walk(os.path.join(root, top)):
            for f in fs:
                if f.endswith((".c", ".h")):
                    with open(os.path.join(dp, f), encoding="utf-8", errors="replace") as fh:
                        parsed |= set(re.findall(r"\"(?:--)?([a-z][a-z0-9-]+)\"", fh.read()))
    for ln, l in enumerate(text.split("\n"), 1):
        for flag in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]+)", l):
            name = flag[3:] if flag.startswith("no-") else flag
            if flag != "help" and name not in parsed:
                bad.append(f"README.md:{ln}: names --{flag}, which no command parses")


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
    check_readme(root, bad)
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
