#!/bin/bash
# Issue 37's training run (the m21 target on a mix of tools/data/gsm2.py and tools/data/gsm.py, and
# its DSpark draft) on the GPU
# machine, in parts that each fit one device command (< 9 minutes), from the repository root.
#
#   tools/train/gpu_job37.sh [auto]   does the next part: a target part until the target has its
#                                     TARGET_MIN of training, then the draft, then nothing
#   tools/train/gpu_job37.sh target | draft | status
#
# Run the same command again and again through the device tool, with no carry:
#   run(command="bash tools/train/gpu_job37.sh", timeout_s=600)
# Each call trains PART_MIN minutes (resuming from the checkpoint of the call before: the cosine
# spans the whole TARGET_MIN / DRAFT_MIN, the data stream restarts at a seed derived from the step
# so no example repeats), saves the resumable checkpoint (weights + AdamW state + step) under
# $JOB, and puts the current exported model into $OUT as gsm37.tar.part-aa, -ab, ... (15 MiB
# each) plus the logs.  Here: `cat FILES_AT/gsm37.tar.part-* | tar xf - -C DIR` gives DIR/gsm37
# (the target folder, with draft/ once the draft has trained).
#
# The checkpoint lives on the device machine ($JOB, default /tmp/job37): it survives between calls
# while the machine is warm (one session), not a fresh machine.  The fp32 checkpoint with AdamW
# state (~230 MB) cannot travel: the device tool carries at most 64 MiB including the repository
# (~58 MiB already).  Plan a whole run in one session: with the defaults (2 target parts of 6.25
# min, one draft part of 4.5 min) that is calls of 8.1, 8.2 and 6.7 minutes, 26.4 minutes of device
# time with a 3-minute start (session 24).
# The target trains on 1024-token rows by default: the trainer's chunked KDA runs T/64 chunks one
# after another, so 2048-token rows should cost ~2x the time per token (estimated); the
# draft, whose acceptance is what collapsed past its training length, trains on 2048 (m20's
# max_model_len).  TARGET_SEQ=2048 TARGET_BATCH=24 trains the target on the full length.
# (Defaults as session 24 ran them: its machine took ~3 minutes to start, which left no room for
# 13 + 6.) Environment: SIZE (m21: m20's shape with 12 KDA heads of dim 32, so PP 2 x TP 4 can split it;
# m20 is the first issue-37 model), GSM (the data mix, default
# tools/data/gsm2.py:0.75,tools/data/gsm.py:0.25: each example from a generator with its weight; a
# single path trains on one generator), TARGET_MIN (12.5), DRAFT_MIN (4.5), PART_MIN (6.25), JOB (/tmp/job37), SEED (0),
# TARGET_BATCH (48), TARGET_SEQ (1024), DRAFT_BATCH (12), WORKERS (10), TRAIN_ARGS (appended to both trainer calls;
# a CPU dry run of the whole sequence: TARGET_MIN=0.4 DRAFT_MIN=0.2 PART_MIN=0.2 WORKERS=1
# TARGET_BATCH=4 TARGET_SEQ=128 DRAFT_BATCH=2 TRAIN_ARGS="--smoke --eval-n 2 --max-new 16"
# TARGET_ARGS="--final-eval-n 2"),
# TARGET_ARGS (target only), INIT (an exported target folder, e.g. models/gsm-k3: the first target part
# starts from its weights with a new optimizer and schedule instead of from random ones, so that
# training goes on in a later session; give it another SEED so the data stream is new).
set -u
JOB=${JOB:-/tmp/job37}
TOK=tools/data/tok37
GSM=${GSM:-tools/data/gsm2.py:0.75,tools/data/gsm.py:0.25}
SIZE=${SIZE:-m21}
TARGET_MIN=${TARGET_MIN:-12.5}
DRAFT_MIN=${DRAFT_MIN:-4.5}
PART_MIN=${PART_MIN:-6.25}
SEED=${SEED:-0}
WORKERS=${WORKERS:-10}
OUT=${OUT:-$JOB/out}
export PYTHONUNBUFFERED=1
mkdir -p "$JOB" "$OUT"

# Training minutes done so far according to a checkpoint (0 when there is none).
done_min() {
    [ -f "$1" ] || { echo 0; return; }
    python3 -c "import torch,sys; s=torch.load(sys.argv[1],map_location='cpu',weights_only=False)['state']; print(round(s['train_s']/60,3))" "$1"
}

# Minutes left of a budget; under 0.3 min (or 5% of it) counts as done (a part that met its wall limit a few
# seconds early must not cost a whole extra call).
left() { python3 -c "import sys; b = float(sys.argv[1]); l = b - float(sys.argv[2]); print(l if l >= min(0.3, 0.05 * b) else 0.0)" "$1" "$2"; }

ship() {  # the current model folder and the logs into $OUT (at most 8 files of 16 MiB)
    cp "$JOB"/*.log "$JOB"/gsm37/ 2>/dev/null
    rm -f "$OUT"/gsm37.tar.part-*
    (cd "$JOB" && tar cf - --exclude='*.pt' --exclude='.staging-*' gsm37) | split -b 15M - "$OUT/gsm37.tar.part-"
    cp "$JOB"/*.log "$OUT"/ 2>/dev/null
    ls -la "$OUT"
}

part_target() {
    local resume=() d
    d=$(done_min "$JOB/target.pt")
    if [ -f "$JOB/target.pt" ]; then
        resume=(--resume "$JOB/target.pt")
    elif [ -n "${INIT:-}" ]; then  # a first part that goes on from an exported model
        resume=(--init-from "$INIT")
    fi
    echo "== target part: $d of $TARGET_MIN min done before this call (size $SIZE, data $GSM)"
    python3 tools/train/train.py target --size "$SIZE" --gsm "$GSM" --tokenizer $TOK --out "$JOB/gsm37" \
        --ckpt "$JOB/target.pt" "${resume[@]}" --minutes "$TARGET_MIN" --session-min "$PART_MIN" \
        --max-wall-min 8.6 --batch "${TARGET_BATCH:-48}" --seq-len "${TARGET_SEQ:-1024}" --workers "$WORKERS" --seed "$SEED" \
        --eval-every 500 --eval-n 32 --max-new 160 --final-eval-n 64 --save-every-min 2 ${TRAIN_ARGS:-} ${TARGET_ARGS:-} \
        2>&1 | tee -a "$JOB/target.log" | grep -v '^\s*$'
    return "${PIPESTATUS[0]}"
}

part_draft() {
    local resume=() d
    d=$(done_min "$JOB/draft.pt")
    [ -f "$JOB/draft.pt" ] && resume=(--resume "$JOB/draft.pt")
    echo "== draft part: $d of $DRAFT_MIN min done before this call"
    python3 tools/train/train.py draft --size "$SIZE" --gsm "$GSM" --target "$JOB/gsm37" --tokenizer $TOK \
        --out "$JOB/gsm37/draft" --ckpt "$JOB/draft.pt" "${resume[@]}" --minutes "$DRAFT_MIN" \
        --session-min "$PART_MIN" --max-wall-min 8.6 --batch "${DRAFT_BATCH:-12}" --workers "$WORKERS" \
        --seed "$SEED" --eval-every 300 --eval-n 48 --max-new 160 --save-every-min 2 ${TRAIN_ARGS:-} \
        2>&1 | tee -a "$JOB/draft.log" | grep -v '^\s*$'
    return "${PIPESTATUS[0]}"
}

case "${1:-auto}" in
auto|target|draft)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    python3 -c 'import torch, tiktoken; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
    step=${1:-auto}
    if [ "$step" = auto ]; then
        if [ "$(left "$TARGET_MIN" "$(done_min "$JOB/target.pt")")" != 0.0 ]; then step=target
        elif [ "$(left "$DRAFT_MIN" "$(done_min "$JOB/draft.pt")")" != 0.0 ]; then step=draft
        else echo "target and draft are done: shipping them"; ship; exit 0; fi
    fi
    rc=0
    if [ "$step" = target ]; then part_target || rc=$?; else part_draft || rc=$?; fi
    echo "== $step part exit $rc; target $(done_min "$JOB/target.pt")/$TARGET_MIN min," \
         "draft $(done_min "$JOB/draft.pt")/$DRAFT_MIN min"
    ship
    exit $rc
    ;;
status)
    echo "target $(done_min "$JOB/target.pt")/$TARGET_MIN min, draft $(done_min "$JOB/draft.pt")/$DRAFT_MIN min"
    tail -5 "$JOB"/*.log 2>/dev/null
    ;;
*)
    echo "usage: $0 [auto|target|draft|status]" >&2
    exit 2
    ;;
esac
