#!/usr/bin/env bash
# The first thing to run on a new GPU machine: each check prints one ok/FAIL line and goes on, so that one run
# finds what is left to fix (docs/training.md#memory). Logs and runs go to $OUT. About 15 minutes on 2+ GPUs.
#
#   bash scripts/gpu_smoke.sh                  # NGPU=2 OUT=/tmp/depthbench-smoke by default
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/depthbench-smoke}
NGPU=${NGPU:-2}
mkdir -p "$OUT"
SYN=(--data synthetic --eval-iters 1)

check() {  # check NAME COMMAND...: ok or FAIL, the log's last line, and the run's planned vs measured memory
    local name=$1 rc
    shift
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local plan peak
    plan=$(grep -o "planned [0-9.]* GB" "$OUT/$name.log" | head -1)
    peak=$(grep -o "peak_mem [0-9.]* GB" "$OUT/$name.log" | tail -1)
    if [ $rc -eq 0 ]; then echo "ok    $name  ${plan:+($plan${peak:+, $peak})}"
    else echo "FAIL  $name (exit $rc): $(tail -1 "$OUT/$name.log")  [$OUT/$name.log]"; fi
}
peak() {  # the measured peak of the newest run.json
    python -c "import json, sys; print(f\"peak_mem {json.load(open(sys.argv[1]))['peak_mem_bytes'] / 1e9:.1f} GB\")" \
        "$(ls -t "$OUT"/runs*/*/run.json | head -1)"
}
export OUT && export -f peak  # for the checks that run in `bash -c`
DESIGNS=$(python -c "import residuals; print(','.join(residuals.RESIDUALS))")

check install python -m pip install -q -r requirements.txt
check cuda python -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())"
for suite in 400m 302m-backbone ladder 1.6b; do
    rows=$(python -c "import shapes; print(','.join(map(str, range(len(shapes.SUITES['$suite'][1])))))")
    check "dry-run-$suite" python train.py --suite "$suite" --row "$rows" --residual "$DESIGNS" --dry-run
done
for design in preln hc attnres; do  # bf16, compiled, 20 steps at 400M L24, its default micro-batch
    check "train-400m-L24-$design" bash -c "python train.py --suite 400m --layers 24 --residual $design --max-steps 20 \
        --global-batch 16 ${SYN[*]} --out $OUT/runs && peak"
done
check "train-400m-L24-attnres-checkpointed" bash -c "python train.py --suite 400m --layers 24 --residual attnres \
    --max-steps 20 --global-batch 16 --activation-checkpointing ${SYN[*]} --out $OUT/runs-ckpt && peak"
check "train-1.6b-L54-attnres-eager" bash -c "python train.py --suite 1.6b --layers 54 --residual attnres --max-steps 3 \
    --no-compile --global-batch 4 ${SYN[*]} --out $OUT/runs && peak"  # the plan's largest row, eager (the plan's upper bound)
for engine in ddp fsdp; do
    flag=$([ $engine = fsdp ] && echo --fsdp)
    check "torchrun-$NGPU-$engine" bash -c "torchrun --standalone --nproc_per_node=$NGPU train.py --suite 400m \
        --layers 24 --residual hc --max-steps 10 --global-batch 32 $flag ${SYN[*]} --out $OUT/runs-$engine && peak"
done
check "ddp-equals-fsdp" python -c "
import json, glob
a, b = (json.load(open(glob.glob('$OUT/runs-' + e + '/*/run.json')[0]))['steps'] for e in ('ddp', 'fsdp'))
d = max(abs(x['loss'] - y['loss']) for x, y in zip(a, b)); print(f'largest loss difference {d:.2e}'); assert d < 2e-2"
check "resume-fsdp-from-ddp" torchrun --standalone --nproc_per_node="$NGPU" train.py --suite 400m --layers 24 \
    --residual hc --max-steps 12 --global-batch 32 --fsdp --resume "${SYN[@]}" --out "$OUT/runs-ddp"
check "profile-2-shapes" python profile_gpu.py --shapes 24x1024,70x640 --residual preln,hc,attnres,moda --seq 2048 \
    --batch 4 --repeats 3 --out "$OUT/profile.json"
