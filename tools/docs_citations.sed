# docs_citations.sed — rewrites the code's citations of the design notes that lived outside the
# repository (MODEL_SPEC.md, DESIGN.md) to the repository's own docs/ (issue 31):
#   sed -i -f tools/docs_citations.sed $(git grep -lE 'MODEL_SPEC|DESIGN(\.md| invariant)')
# docs/model.md keeps MODEL_SPEC's section numbers, docs/architecture.md DESIGN's invariant
# numbers, so a citation keeps its number. tools/check_docs.py checks that each one resolves.
# Order matters: the specific forms first, the bare names last. Afterwards run clang-format on
# the files it changed (longer names push some comment lines past 100 columns; it reflows them).

# a `// ---- title (MODEL_SPEC §x) ----` banner keeps its width: the name grows by 3 characters
/MODEL_SPEC [^.].*----$/s/---$//
# a path to the old notes (/work/shared/..., ../shared/...)
s#\(\.\./\)*\(/work/\)\{0,1\}shared/MODEL_SPEC\.md#docs/model.md#g
s#\(\.\./\)*\(/work/\)\{0,1\}shared/DESIGN\.md#docs/architecture.md#g
# "MODEL_SPEC trap 4": the traps are §10
s#MODEL_SPEC\(\.md\)\{0,1\} trap#docs/model.md §10 trap#g
# "MODEL_SPEC preamble": our choices where the sources differ are in §0
s#MODEL_SPEC\(\.md\)\{0,1\} preamble#docs/model.md §0#g
# "MODEL_SPEC §5.4", "MODEL_SPEC.md §1", "MODEL_SPEC.md", "(MODEL_SPEC)"
s#MODEL_SPEC\.md#docs/model.md#g
s#MODEL_SPEC#docs/model.md#g
# DESIGN.md's "Process model" is docs/parallelism.md's (also when the quote wraps to the next line)
s#DESIGN\.md, *"Process model"#docs/parallelism.md, "Process model"#g
s#(DESIGN\.md,$#(docs/parallelism.md,#
# "DESIGN invariant: <= 1e-4" (the full forward against the reference)
s#DESIGN invariant:#docs/architecture.md invariant 2:#g
# "DESIGN.md invariant 3", "as DESIGN.md asks", a bare "DESIGN.md"
s#DESIGN\.md#docs/architecture.md#g
