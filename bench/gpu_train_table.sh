#!/usr/bin/env bash
# The training step's speed on one CUDA GPU, as docs/REPORT.md's "Training step speed" tables give
# it (bench/train_speed_bench.py: step ms, audio s/s, tokens/s, TFLOP/s, MFU, peak memory and the
# phases), for canary-1b-flash and canary-180m-flash, eager and compiled, without and with activation
# checkpointing, then the CUDA tests: one call of a GPU machine held for a few minutes.
#
#     bench/gpu_train_table.sh TOKENIZER OUT [PART ...]
#
# TOKENIZER: a train.tokenizer directory; its vocabulary sizes the output layer, and Canary's 5,248
# ids make the step Canary's (the batches are artificial: random features and ids). One of that
# size: `python tools/train_tokenizer.py --manifest data/long/train.jsonl --layout aggregate
# --vocab-size 1308 -o TOKENIZER` (data/make_mini_data.py's docstring makes data/long).
# OUT: every part writes OUT/PART.json (train_speed_bench.py --save: what it measured so far, also
# when its time limit stops it) and OUT/PART.log, and OUT/trace-PART/ a gzipped torch.profiler trace
# of one step of every variant and bucket (chrome://tracing, Perfetto), whose kernel summary (where
# the time goes: matmul, attention, convolution, normalisation and elementwise, optimizer, host gaps;
# the top kernels) is each row's `kernels` in PART.json; the CUDA tests write OUT/cuda-tests.log.
# PART: any of the parts below, in the order given (default: all, most wanted first). Each has its
# own limit in seconds, cut to what is left of BUDGET (default 540 s) when that is less; a part with
# under a minute left is skipped and says so. All five parts at their limits take about 16 minutes,
# the first three about 9: name the parts that one call's time holds. 1b-flash-ckpt measures the
# compiled step alone, to fit its limit (docs/REPORT.md's eager checkpointed row names its commit:
# compare only rows of the same code).
#
# Batch sizes: oom.py's for a simulated 80 GiB card (what an 80 GB GPU holds; an H200 holds more),
# three buckets each (2 s with 16 tokens, 16 s with 128, 40 s with 640), from
#   python oom.py --config PRESET.yaml --bins BINS --simulate-memory 80GiB --memory-model --verify 0 \
#       --strategy ddp -o bs.json
# where PRESET.yaml is the preset with train.tokenizer set to a 5,248-id tokenizer (and
# activation_checkpointing: both for the checkpointed sizes), and BINS has the duration bounds 2, 4,
# 6, 8, 10, 13, 16, 20, 25, 30, 35 and 40 s, each with the token bounds of 8 and 16 tokens per
# second (docs/REPORT.md, "Training step speed", names each run's commit).
#
# The machine's own Python must have what requirements.txt names (a GPU machine without a network
# can take soundfile, jiwer and sentencepiece as wheels); PYTHON overrides `python3`.
set -u
if [ $# -lt 2 ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
tokenizer=$1 out=$2
shift 2
known=(1b-flash 180m-flash 1b-flash-ckpt 180m-flash-ckpt cuda-tests)
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=("${known[@]}")
for part in "${parts[@]}"; do
    [[ " ${known[*]} " == *" $part "* ]] || { echo "unknown part $part (known: ${known[*]})"; exit 2; }
done
mkdir -p "$out"
tokenizer=$(realpath -m "$tokenizer") out=$(realpath -m "$out")  # before the cd below
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -f "$tokenizer/tokenizer.json" ] || { echo "$tokenizer: not a tokenizer directory (no tokenizer.json)"; exit 2; }
"$py" -c "import torch, sys; torch.cuda.is_available() or sys.exit('torch sees no CUDA GPU')" || exit 2
"$py" -c "import aed.train_setup" || { echo "$py cannot import aed: requirements.txt's packages are missing"; exit 2; }

sizes() {  # sizes NAME BATCH_2S BATCH_16S BATCH_40S: oom.py's -o format for the three buckets
    printf '{"bins": {"durations": [2, 16, 40], "tokens": [[16], [128], [640]]}, "batch_sizes": [[%s], [%s], [%s]]}\n' \
        "$2" "$3" "$4" > "$out/$1.json"
}
sizes bs-1b-flash 535 61 12             # oom.py at e5fbaa9
sizes bs-1b-flash-ckpt 4185 507 162     # oom.py at 9ff4f8c, activation_checkpointing: both
sizes bs-180m-flash 1741 181 45         # oom.py at e5fbaa9
sizes bs-180m-flash-ckpt 5943 709 208   # oom.py at 654fbf1, activation_checkpointing: both

deadline=$(( $(date +%s) + ${BUDGET:-540} ))
limit() {  # limit SECONDS: the part's own limit, or what is left of the budget
    local left=$(( deadline - $(date +%s) ))
    echo $(( $1 < left ? $1 : left ))
}
bench() {  # bench PART LIMIT PRESET SIZES ARGS...: train_speed_bench.py under its limit
    local part=$1 seconds preset=$3 batch_sizes=$4
    seconds=$(limit "$2")
    shift 4
    if [ "$seconds" -lt 60 ]; then echo "$part: skipped, ${seconds} s left of the budget"; return; fi
    echo "$part: up to ${seconds} s"
    timeout "$seconds" "$py" bench/train_speed_bench.py "configs/$preset.yaml" "train.tokenizer=$tokenizer" \
        --device cuda --batch-sizes "$out/$batch_sizes.json" --buckets 3 --save "$out/$part.json" \
        --trace "$out/trace-$part" --trace-steps 1 "$@" \
        > "$out/$part.log" 2>&1
    echo "$part: exit $? ($(tail -n 1 "$out/$part.log" | cut -c1-100))"
}
for part in "${parts[@]}"; do
    case $part in
        1b-flash) bench "$part" 170 canary-1b-flash bs-1b-flash --compile both ;;
        180m-flash) bench "$part" 130 canary-180m-flash bs-180m-flash --compile both ;;
        1b-flash-ckpt) bench "$part" 200 canary-1b-flash bs-1b-flash-ckpt --compile on --checkpointing both \
            --steps 2 --warmup 1 ;;
        180m-flash-ckpt) bench "$part" 180 canary-180m-flash bs-180m-flash-ckpt --compile both --checkpointing both \
            --steps 2 --warmup 1 ;;
        cuda-tests)
            seconds=$(limit 300)
            if [ "$seconds" -lt 60 ]; then echo "$part: skipped, ${seconds} s left of the budget"; continue; fi
            echo "$part: up to ${seconds} s"
            timeout "$seconds" "$py" -m pytest -q -rfEs tests/test_cuda.py tests/test_cuda_oom.py \
                > "$out/cuda-tests.log" 2>&1
            echo "$part: exit $? ($(tail -n 1 "$out/cuda-tests.log"))" ;;
    esac
done
"$py" -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA',
    torch.version.cuda)"
