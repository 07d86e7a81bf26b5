#!/bin/bash
# The bundled model's training run on the GPU machine (device tool), from the repository root.
# The device tool's commands last at most 10 minutes, so the run goes on in the background and
# later commands watch it and collect the result:
#   gpu_job.sh start TARGET_MIN DRAFT_MIN   checks, then trains target and draft in the background
#   gpu_job.sh wait SECONDS                 waits for the job (at most SECONDS), prints progress
#   gpu_job.sh collect                      packs the trained folders into $OUT (15 MB parts)
set -u
JOB=/tmp/dsjob
TOK=models/gsm-k3
export PYTHONUNBUFFERED=1
case "${1:-}" in
start)
    mkdir -p $JOB
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
    python3 tools/train/check_equiv.py > $JOB/check_equiv.log 2>&1 || { tail -20 $JOB/check_equiv.log; exit 1; }
    tail -2 $JOB/check_equiv.log
    cat > $JOB/run.sh <<RUN
cd $PWD
date +%s > $JOB/t_start
python3 tools/train/train.py target --tokenizer $TOK --out $JOB/gsm-k3 --minutes $2 \
    --max-wall-min \$(python3 -c "print($2 + 1.5)") --seed 0 --ckpt $JOB/target.pt > $JOB/target.log 2>&1
echo "target exit \$?" >> $JOB/status
python3 tools/train/train.py draft --target $JOB/gsm-k3 --tokenizer $TOK --out $JOB/gsm-k3/draft \
    --minutes $3 --max-wall-min \$(python3 -c "print($3 + 1.5)") --seed 0 --ckpt $JOB/draft.pt > $JOB/draft.log 2>&1
echo "draft exit \$?" >> $JOB/status
date +%s > $JOB/DONE
RUN
    setsid nohup bash $JOB/run.sh > $JOB/run.out 2>&1 < /dev/null &
    sleep 45
    tail -5 $JOB/target.log
    ;;
wait)
    end=$(( $(date +%s) + ${2:-540} ))
    while [ ! -f $JOB/DONE ] && [ $(date +%s) -lt $end ]; do sleep 10; done
    cat $JOB/status 2>/dev/null
    echo "--- target"; grep -v "^\s*$" $JOB/target.log | tail -12
    [ -f $JOB/draft.log ] && { echo "--- draft"; tail -12 $JOB/draft.log; }
    [ -f $JOB/DONE ] && echo "JOB DONE"
    ;;
collect)
    cd $JOB && rm -f gsm-k3/*.pt gsm-k3/draft/*.pt
    cp target.log draft.log check_equiv.log gsm-k3/ 2>/dev/null
    tar cf - gsm-k3 | split -b 15M - $OUT/gsm-k3.tar.part-
    ls -la $OUT
    ;;
*)
    echo "usage: $0 start TARGET_MIN DRAFT_MIN | wait SECONDS | collect" >&2
    exit 2
    ;;
esac
