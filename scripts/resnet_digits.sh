#!/usr/bin/env bash
# `resnet --resnet_depth=18 --image_size=32` trains on real digits written in the
# ImageNet TFRecord layout (estimax.tools.digits_imagenet), while a second process in
# --mode=eval follows and evaluates the checkpoints the first one writes. Exits non-zero unless
# the evaluation of the last checkpoint reaches MIN_ACCURACY (default 0.95).
#
# usage: scripts/resnet_digits.sh [WORK_DIR]      (env: PY, TRAIN_STEPS, MIN_ACCURACY)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/estimax_resnet_digits}
PY=${PY:-.venv/bin/python}
# 35 epochs of the 4,000 training digits at batch 64: the recipe's schedule (5 warm-up epochs,
# x0.1 at epoch 30 = step 1875) decays once. 20 epochs without the decay reached 90.5%.
TRAIN_STEPS=${TRAIN_STEPS:-2190}
CANVAS=${CANVAS:-44}                # see estimax/tools/digits_imagenet.py
MIN_ACCURACY=${MIN_ACCURACY:-0.95}
rm -rf "$WORK/model"
mkdir -p "$WORK"
[ -e "$WORK/data/validation-00001-of-00002" ] || \
    $PY -m estimax.tools.digits_imagenet --output_dir="$WORK/data" --canvas_size="$CANVAS"

# The seed's command line plus what the small data set needs: 10 classes, its size (for the
# epochs of the learning-rate schedule), smaller batches, and a checkpoint every 125 steps so the
# evaluator has several to follow. --num_cores=1: one CPU device.
FLAGS=(--data_dir="$WORK/data" --model_dir="$WORK/model" --resnet_depth=18 --image_size=32
       --num_label_classes=10 --num_train_images=4000 --num_eval_images=1000
       --train_batch_size=64 --eval_batch_size=200 --base_learning_rate=0.4
       --train_steps="$TRAIN_STEPS" --iterations_per_loop=125 --num_cores=1)

start=$(date +%s)
$PY -m estimax.programs.resnet "${FLAGS[@]}" --mode=train > "$WORK/train.log" 2>&1 &
train_pid=$!
# A second process: evaluates each checkpoint as it appears, stops after the one at train_steps.
$PY -m estimax.programs.resnet "${FLAGS[@]}" --mode=eval --eval_timeout=1800 \
    > "$WORK/eval.log" 2>&1 || { echo "eval process failed, see $WORK/eval.log"; exit 1; }
wait "$train_pid" || { echo "train process failed, see $WORK/train.log"; exit 1; }
echo "wall seconds: $(( $(date +%s) - start ))"
grep -E "loss = .*, step = " "$WORK/train.log" | sed 's/.*\] //' | tail -n 12
grep -E "Saving dict for global step" "$WORK/eval.log" | sed 's/.*\] //'
final=$(grep -E "^Eval results at step" "$WORK/eval.log" | tail -n 1)
echo "$final"
acc=$(echo "$final" | sed -E 's/.*top_1_accuracy = ([0-9.]+).*/\1/')
$PY -c "import sys; a=float('$acc'); print('top_1_accuracy', a, '>=', $MIN_ACCURACY, a >= $MIN_ACCURACY); sys.exit(0 if a >= $MIN_ACCURACY else 1)"
