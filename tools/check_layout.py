#!/usr/bin/env python3
"""check_layout.py — the layout rules of docs/architecture.md, checked over src/:

  1. includes: a file in folder F includes only headers of F and of the folders F may use
     (LAYERS below, the table docs/architecture.md draws);
  2. no include loop between modules (x.c and x.h are one module);
  3. no file over 1,000 lines and no function over 120 lines, unless a comment in the file's or
     the function's first lines says why (it contains "long:");
  4. `DS_HAVE_CUDA` only in the backend registry (src/backend/registry.c) and the build.

Prints every breach and exits 1 if there is one. Run by `make test` (ctest: check_layout)."""
import os
import re
import sys

# folder -> folders it may include besides itself (transitively closed by hand: a layer lists
# everything below it that it uses)
LOW = ["base"]
LAYERS = {
    "base": [],
    "io": ["base", "kernels/shared"],
    "text": ["base", "io"],
    "kernels/shared": ["base"],
    "kernels/cpu": ["base", "io", "kernels/shared"],
    "kernels/cuda": ["base", "kernels/shared"],
    "sample": ["base", "io", "kernels/cpu", "kernels/shared"],
    "transport": ["base"],
    "model": ["base", "io", "text", "kernels/cpu", "kernels/shared", "sample", "transport"],
    "backend": ["base", "io", "kernels/cpu", "kernels/shared", "sample", "transport", "model",
                "backend/cpu", "backend/cuda"],
    "backend/cpu": ["base", "io", "kernels/cpu", "kernels/shared", "sample", "transport", "model",
                    "backend"],
    "backend/cuda": ["base", "io", "kernels/cpu", "kernels/cuda", "kernels/shared", "sample",
                     "transport", "model", "backend"],
    "parallel": ["base", "io", "kernels/cpu", "kernels/shared", "sample", "transport", "model"],
    "cache": ["base", "io", "kernels/cpu", "kernels/shared", "sample", "model"],
    "engine": ["base", "io", "text", "kernels/cpu", "kernels/shared", "sample", "transport",
               "model", "parallel", "cache"],
    "server": ["base", "io", "text", "kernels/cpu", "kernels/shared", "sample", "model", "cache",
               "engine"],
    "devtools": ["base", "io", "text", "kernels/cpu", "kernels/shared", "sample", "transport",
                 "model", "parallel", "cache", "engine", "server", "cli"],
    "cli": ["base", "io", "text", "kernels/cpu", "kernels/shared", "sample", "transport", "model",
            "parallel", "cache", "engine", "server", "devtools"],
}
MAX_FILE, MAX_FUNC = 1000, 120
SRC_EXT = (".c", ".h", ".cu", ".cuh")


def folder_of(rel):  # rel: path under src/
    d = os.path.dirname(rel)
    while d and d not in LAYERS:
        d = os.path.dirname(d)
    return d


def functions(lines):
    """(name, first line, last line) of each top-level function: a line at column 0 that ends a
    signature with '{' (or a '{' alone at column 0 after one), through the next '}' at column 0."""
    out, i, n = [], 0, len(lines)
    sig = re.compile(r"^[A-Za-z_][\w \*\(\),\[\]<>:&]*\b(\w+)\s*\(")
    while i < n:
        m = sig.match(lines[i])
        if m and not lines[i].startswith(("typedef", "struct ", "enum ", "union ", "#")):
            j = i
            while j < n and "{" not in lines[j] and ";" not in lines[j] and j - i < 12:
                j += 1
            if j < n and "{" in lines[j] and ";" not in lines[j].split("{")[0]:
                k = j
                if not lines[j].rstrip().endswith("}"):
                    k = j + 1
                    while k < n and not lines[k].startswith("}"):
                        k += 1
                out.append((m.group(1), i, k))
                i = k + 1
                continue
        i += 1
    return out


def says_why(lines, first):
    """A 'long:' comment in the 6 lines above a function or its first 4 lines."""
    return any("long:" in l for l in lines[max(0, first - 6):first + 4])


def main(root):
    src = os.path.join(root, "src")
    bad = []
    graph = {}
    for dp, _, fs in os.walk(src):
        for f in sorted(fs):
            if not f.endswith(SRC_EXT):
                continue
            path = os.path.join(dp, f)
            rel = os.path.relpath(path, src)
            with open(path, encoding="utf-8", errors="replace") as fh:
                lines = fh.read().split("\n")
            folder = folder_of(rel)
            if folder not in LAYERS:
                bad.append(f"src/{rel}: folder '{os.path.dirname(rel)}' is not in the layer table")
                continue
            allowed = set(LAYERS[folder]) | {folder}
            mod = re.sub(r"_impl$", "", os.path.splitext(rel)[0])
            for ln, l in enumerate(lines, 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)"', l)
                if m:
                    inc = m.group(1)
                    tf = folder_of(inc)
                    if tf not in allowed:
                        bad.append(f"src/{rel}:{ln}: includes {inc} ({tf or '?'}), which "
                                   f"{folder}/ may not use")
                    graph.setdefault(mod, set()).add(re.sub(r"_impl$", "", os.path.splitext(inc)[0]))
                if "DS_HAVE_CUDA" in l and rel != "backend/registry.c":
                    bad.append(f"src/{rel}:{ln}: DS_HAVE_CUDA outside the backend registry")
            if len(lines) > MAX_FILE and not any("long:" in l for l in lines[:30]):
                bad.append(f"src/{rel}: {len(lines)} lines (> {MAX_FILE}) and no 'long:' comment "
                           "at its top saying why")
            for name, a, b in functions(lines):
                if b - a + 1 > MAX_FUNC and not says_why(lines, a):
                    bad.append(f"src/{rel}:{a + 1}: function {name} is {b - a + 1} lines "
                               f"(> {MAX_FUNC}) and no 'long:' comment says why")
    # include loops between modules
    state = {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if v == u:
                continue
            if state.get(v) == 1:
                cyc = stack[stack.index(v):] + [v]
                bad.append("include loop: " + " -> ".join(cyc))
            elif v in graph and not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if not state.get(u):
            visit(u, [])
    for b in bad:
        print(b)
    if bad:
        print(f"check_layout: {len(bad)} breach(es) of docs/architecture.md's rules")
        return 1
    print("check_layout: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
