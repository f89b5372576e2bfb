#!/usr/bin/env bash
# Every long training run behind docs/RESULTS.md and models/, in order, in two lanes that can run
# side by side on a 2-core machine (one thread each):
#
#   bash training/runs.sh study   # Multi30K de->en ablation study
#   bash training/runs.sh ship    # summarisation, en->de, then the study's Graph and GRET-from-scratch runs and their control
#   bash training/runs.sh giga-vocab  # Gigaword with a 4000-piece vocabulary, from scratch
#   bash training/runs.sh gret-a & bash training/runs.sh gret-b & bash training/runs.sh gret-c   # GRET's scale switches (docs/GRET.md)
#   bash training/runs.sh gret-d & bash training/runs.sh gret-e   # the scale switches from scratch, with mvPE + POS
#   bash training/runs.sh gret-f & bash training/runs.sh gret-g   # a lighter bag-of-words loss and dropout on s^M
#   bash training/runs.sh gret-h & bash training/runs.sh gret-i   # between the two: bag-of-words weight against s^M dropout
#   bash training/runs.sh gret-j & bash training/runs.sh gret-k   # the gate with bag-of-words 0.2; a second control seed
#   bash training/runs.sh gret-l & bash training/runs.sh gret-m   # twice the budget: bag-of-words 0.2 and its control
#   bash training/runs.sh gret-n & bash training/runs.sh gret-o   # dropout 0.3: a control and bag-of-words 0.2
#   bash training/runs.sh gret-p & bash training/runs.sh gret-q   # the same two at twice the steps
#   bash training/runs.sh gret-r & bash training/runs.sh gret-s   # dropout 0.3, 5300 steps: the light and the gated variant
#   bash training/runs.sh gret-t & bash training/runs.sh gret-u   # the light variant and its control at 10600 steps
#   bash training/runs.sh gret-v & bash training/runs.sh gret-w   # Gigaword from scratch: the gated and the light variant
#
# Budget rule (the multi-view paper's continued-learning check): a vanilla baseline is trained
# from scratch; each warm-started variant continues it for EXTRA steps with one schedule, and a
# control continues the unchanged baseline for the same EXTRA steps. Variants that change the
# embeddings or the encoder (mvPE, POS tags, Graph-Transformer) cannot start from the baseline:
# they train from scratch for baseline + EXTRA steps, the control's total, and are compared with a vanilla
# model trained from scratch the same way (deen-scratch-control): a restart from a converged baseline, with
# checkpoint averaging, is an advantage of its own.
#
# Shipping rule (models/): per task and direction, the finished run with the best validation score
# (training.ship measures and records it); within 0.1 BLEU/ROUGE of the best, a vanilla model is
# preferred, because it runs on every backend, CTranslate2 included.
#
# A finished run is skipped; an interrupted one resumes exactly (training.train's state/).
# Output: runs/NAME/ (checkpoint + log.jsonl) and runs/NAME.out (progress).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-1}
EXTRA=800          # extra steps of every continued run
DEEN_BASE=1850     # steps of the de->en baseline (runs/deen-base)
SUM_BASE=1500      # steps of the summarisation baselines

run() {  # run NAME STEPS ARGS...: train runs/NAME to STEPS steps unless it is already there
  local name=$1 steps=$2; shift 2
  if grep -qs "\"event\": \"done\", \"step\": $steps," "runs/$name/log.jsonl"; then
    echo "$name: done"; return
  fi
  echo "$name: training to $steps steps ($(date -u +%H:%M))"
  mkdir -p runs
  # one process per run, whichever lane starts it
  flock --nonblock --conflict-exit-code 75 "runs/$name.lock" \
    $PY -m training.train --out "runs/$name" --max-steps "$steps" --threads "$THREADS" "$@" >>"runs/$name.out" 2>&1 ||
    { local status=$?; [ $status -ne 75 ] || echo "$name: another lane is training it; this lane stops" >&2; return $status; }
}

continued() {  # continued NAME BASE ARGS...: EXTRA steps warm-started from checkpoint BASE
  local name=$1 base=$2; shift 2
  run "$name" "$EXTRA" --init-from "$base" --lr 5e-4 --warmup 200 --batch-tokens 3000 --eval-every 200 \
    --average-last 3 "$@"
}

study() {
  local deen="--dropout 0.1"
  # the baseline: trained from scratch, shipped (fp16, as every continued run starts from it)
  run deen-vanilla-1h $DEEN_BASE --batch-tokens 3000 --dropout 0.1 --eval-every 500
  [ -f runs/deen-base/metrics.json ] || $PY -m training.ship --checkpoint runs/deen-vanilla-1h --out runs/deen-base
  continued deen-control runs/deen-base $deen
  continued deen-gret-full runs/deen-base $deen --gret full
  continued deen-gret-capsule runs/deen-base $deen --gret capsule
  continued deen-gret-capsule-aggregate runs/deen-base $deen --gret capsule,aggregate
  continued deen-gret-capsule-gate runs/deen-base $deen --gret capsule,gate
  continued deen-multiview-gca runs/deen-base $deen --multiview gca
  continued deen-multiview-ama runs/deen-base $deen --multiview ama
  local scratch="--batch-tokens 3000 --dropout 0.1 --eval-every 500"
  run deen-mvpe $((DEEN_BASE + EXTRA)) $scratch --mvpe
  run deen-mvpe-pos $((DEEN_BASE + EXTRA)) $scratch --mvpe --pos-tags
}

GIGA_V4K="--dataset gigaword --dropout 0.3 --vocab-size 4000 --batch-tokens 3000 --eval-every 250 --average-last 3"
giga_vocab() {  # Gigaword with half the vocabulary: 10k pairs leave many of 8000 pieces rarely seen
  run giga-v4k 2500 $GIGA_V4K
}

study_tail() {  # the study's last variants, in the ship lane (free once the summarisation runs are done)
  local scratch="--batch-tokens 3000 --dropout 0.1 --eval-every 500"
  run deen-graph $((DEEN_BASE + EXTRA)) $scratch --encoder graph --graph-half-dim --graph-fusion weight_gate
  # GRET as its paper trains it: every module from the first step, not bolted onto a converged baseline,
  # and the context gate at the usual zero bias (the -3 default keeps a warm-started model near its baseline)
  run deen-gret-scratch $((DEEN_BASE + EXTRA)) $scratch --gret full --gate-bias-init 0
  # their control: vanilla, trained from scratch the same way
  run deen-scratch-control $((DEEN_BASE + EXTRA)) $scratch
}

ship() {
  local giga="--dataset gigaword --dropout 0.3"
  run giga-vanilla $SUM_BASE $giga --batch-tokens 3000 --eval-every 250
  continued giga-control runs/giga-vanilla $giga
  continued giga-gret-full runs/giga-vanilla $giga --gret full
  run ende-vanilla 2000 --src en --tgt de --batch-tokens 3000 --dropout 0.1 --eval-every 500
  local aeslc="--dataset aeslc --dropout 0.3"
  run aeslc-vanilla $SUM_BASE $aeslc --batch-tokens 3000 --eval-every 250
  # the control's validation ROUGE still rose at its last evaluation: continue it further
  run giga-long 1200 --init-from runs/giga-control --lr 5e-4 --warmup 200 --batch-tokens 3000 --eval-every 200 \
    --average-last 3 $giga
  continued aeslc-control runs/aeslc-vanilla $aeslc
  continued aeslc-gret-full runs/aeslc-vanilla $aeslc --gret full
  # giga-long's validation peaked mid-run (step 800): polish its best checkpoint at a lower rate
  run giga-polish 800 --init-from runs/giga-long --lr 2e-4 --warmup 100 --batch-tokens 3000 --eval-every 100 \
    --average-last 3 --seed 2 $giga
  study_tail
}

# GRET with its global state on the decoder state's scale (docs/GRET.md), in two lanes. Continued from the
# shipped vanilla models (the baselines a user has), each against a control continued the same EXTRA steps.
SCALED="--gret capsule,gate --global-norm --global-zero-bias --routing-scale --gate-bias-init 0"
gret_a() {
  continued deen2-control models/multi30k-de-en-vanilla --dropout 0.1
  continued giga2-control models/gigaword-headlines --dropout 0.3
}
gret_b() {
  continued deen2-gret-scaled-bow models/multi30k-de-en-vanilla --dropout 0.1 $SCALED --global-bow 0.5
  continued giga2-gret-scaled-bow models/gigaword-headlines --dropout 0.3 $SCALED --global-bow 0.5
}
# the probe found the gated variant closing its gate (g ~ 0.05): without the gate, s^M is added as it is
gret_c() {
  continued deen2-gret-ungated-bow models/multi30k-de-en-vanilla --dropout 0.1 \
    --gret capsule,aggregate --global-norm --global-zero-bias --routing-scale --global-bow 0.5
}

# from scratch, the setting in which GRET learns with the model: the ungated variant (which uses s^M when
# continued) together with mvPE + POS tags (the study's best scratch variant), against the scratch control
gret_d() {
  run deen-scratch-control $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500
}
gret_e() {
  run deen-gret-ungated-mvpe-pos $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags --gret capsule,aggregate --global-norm --global-zero-bias --routing-scale --global-bow 0.5
}

# the mvPE + POS run leaned on s^M (the mean costs 13.6 BLEU) and lost to its control: a lighter hand, with a
# tenth of the bag-of-words weight and dropout on s^M, with and without mvPE + POS to separate the two
LIGHT="--gret capsule,aggregate --global-norm --global-zero-bias --routing-scale --global-bow 0.1 --global-dropout 0.3"
gret_f() {
  run deen-gret-light $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 $LIGHT
}
gret_g() {
  run deen-gret-light-mvpe-pos $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags $LIGHT
}
# the light runs do not use s^M (its mean does as well) and the bow-0.5 run uses it and loses: between
# the two, with mvPE + POS (the better base), which of the weight and the dropout decides
SCALED_UNGATED="--gret capsule,aggregate --global-norm --global-zero-bias --routing-scale"
gret_h() {
  run deen-gret-bow5-drop-mvpe-pos $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags $SCALED_UNGATED --global-bow 0.5 --global-dropout 0.3
}
gret_i() {
  run deen-gret-bow2-mvpe-pos $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags $SCALED_UNGATED --global-bow 0.2
}
# both read s^M and neither beats the control on test_2016: the gate (the paper's full model, at bias 0)
# lets each output token choose how much of s^M it takes; and a second control seed, to know how far
# two vanilla runs differ by their seed alone
gret_j() {
  run deen-gret-gated-bow2-mvpe-pos $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags --gret capsule,aggregate,gate --global-norm --global-zero-bias --routing-scale \
    --gate-bias-init 0 --global-bow 0.2
}
gret_k() {
  run deen-scratch-control-seed2 $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.1 --eval-every 500 --seed 2
}
# the gate reads s^M to its loss, and a second seed moves test_2017 by +1.13 alone; the controls' validation
# curves have not clearly levelled off at 2650 steps, so the budget is the axis left: twice the steps for
# the variant that reads s^M and its control
gret_l() {
  run deen-gret-bow2-mvpe-pos-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.1 --eval-every 500 \
    --mvpe --pos-tags $SCALED_UNGATED --global-bow 0.2
}
gret_m() {
  run deen-scratch-control-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.1 --eval-every 500
}

# twice the steps moved neither system's validation much: both fit 29k pairs at dropout 0.1. With a third of
# the units dropped, does the variant's global state help once the model overfits less?
gret_n() {
  run deen-scratch-control-drop3 $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.3 --eval-every 500
}
gret_o() {
  run deen-gret-bow2-mvpe-pos-drop3 $((DEEN_BASE + EXTRA)) --batch-tokens 3000 --dropout 0.3 --eval-every 500 \
    --mvpe --pos-tags $SCALED_UNGATED --global-bow 0.2
}

# neither reached its best at 2650 steps (validation still rising at dropout 0.3): twice the steps, continuing
# each 2650-step run in a copy (the learning rate does not depend on the step budget and a run resumes exactly,
# so this is the 5300-step run from scratch, plus one extra evaluation at step 2650)
extend() {  # extend FROM TO: TO starts as a copy of the finished run FROM
  [ -d "runs/$2" ] || cp -r "runs/$1" "runs/$2"
}
gret_p() {
  gret_n
  extend deen-scratch-control-drop3 deen-scratch-control-drop3-5300
  run deen-scratch-control-drop3-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 --eval-every 500
}
gret_q() {
  gret_o
  extend deen-gret-bow2-mvpe-pos-drop3 deen-gret-bow2-mvpe-pos-drop3-5300
  run deen-gret-bow2-mvpe-pos-drop3-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 \
    --eval-every 500 --mvpe --pos-tags $SCALED_UNGATED --global-bow 0.2
}

# at dropout 0.3 and 5300 steps the control gained 1.8 BLEU and the bag-of-words variant fell further behind.
# The two variants that did best against the dropout-0.1 control, on the better recipe, against
# deen-scratch-control-drop3-5300: the light variant (+0.63 / +1.63, s^M not read) and the gated one
# (-0.05 / +1.34, s^M read), both from scratch for 5300 steps
gret_r() {
  run deen-gret-light-mvpe-pos-drop3-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 \
    --eval-every 500 --mvpe --pos-tags $LIGHT
}
gret_s() {
  run deen-gret-gated-bow2-mvpe-pos-drop3-5300 $((2 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 \
    --eval-every 500 --mvpe --pos-tags --gret capsule,aggregate,gate --global-norm --global-zero-bias --routing-scale \
    --gate-bias-init 0 --global-bow 0.2
}
# validation (greedy) still rose at 5300 steps for both the light variant (+0.85 over the control there) and
# the control: each continues to 10600 steps in a copy, as gret-p/q did
gret_t() {
  gret_r
  extend deen-gret-light-mvpe-pos-drop3-5300 deen-gret-light-mvpe-pos-drop3-10600
  run deen-gret-light-mvpe-pos-drop3-10600 $((4 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 \
    --eval-every 500 --mvpe --pos-tags $LIGHT
}
gret_u() {
  gret_p
  extend deen-scratch-control-drop3-5300 deen-scratch-control-drop3-10600
  run deen-scratch-control-drop3-10600 $((4 * (DEEN_BASE + EXTRA))) --batch-tokens 3000 --dropout 0.3 --eval-every 500
}
# at 10600 steps the light variant beats its control by +1.08 on test_2016 (p 0.017), +1.56 on test_2017, and still
# does not read s^M (the probe: the mean costs 0.37, p 0.171); its val BLEU at beam 4 (43.04) is below the shipped
# 5300-step model's (43.46; python -m training.ship --checkpoint runs/deen-gret-light-mvpe-pos-drop3-10600 --out
# /tmp/ship-light-10600 measures it without shipping). Evaluation:
#   python -m training.study evaluate --name translation-scratch-drop3-10600 --control runs/deen-scratch-control-drop3-10600 \
#     --systems runs/deen-gret-light-mvpe-pos-drop3-10600 --threads 2
#   python -m training.gret_probe --systems runs/deen-gret-light-mvpe-pos-drop3-10600 --name gret-probe-drop3-10600-light --threads 2
# The light variant won the shipping rule (val BLEU 43.46 against the control's 42.77, beam 4):
#   python -m training.ship --checkpoint runs/deen-gret-light-mvpe-pos-drop3-5300 --out models/multi30k-de-en
#   python -m training.ship --checkpoint runs/deen-scratch-control-drop3-5300 --out models/multi30k-de-en-vanilla

# Gigaword from scratch (the paper's largest gains are on summarisation): the two Multi30K variants, the gated
# one (reads s^M) and the light one (gains), each trained exactly as the shipped summariser (giga-v4k). Their
# control is models/gigaword-headlines itself: training repeats exactly (giga-vocab's recipe, rerun for 100 steps,
# logs the loss and gradient norm of its train_log.jsonl; docs/GRET.md), so the shipped weights are the control's,
# rounded to fp16
gret_v() {
  run giga-v4k-gret-gated 2500 $GIGA_V4K --gret capsule,aggregate,gate --global-norm --global-zero-bias \
    --routing-scale --gate-bias-init 0 --global-bow 0.2
}
gret_w() {
  run giga-v4k-gret-light 2500 $GIGA_V4K $LIGHT
}

case "${1:-}" in
  study) study ;;
  ship) ship ;;
  giga-vocab) giga_vocab ;;
  gret-a) gret_a ;;
  gret-b) gret_b ;;
  gret-c) gret_c ;;
  gret-d) gret_d ;;
  gret-e) gret_e ;;
  gret-f) gret_f ;;
  gret-g) gret_g ;;
  gret-h) gret_h ;;
  gret-i) gret_i ;;
  gret-j) gret_j ;;
  gret-k) gret_k ;;
  gret-l) gret_l ;;
  gret-m) gret_m ;;
  gret-n) gret_n ;;
  gret-o) gret_o ;;
  gret-p) gret_p ;;
  gret-q) gret_q ;;
  gret-r) gret_r ;;
  gret-s) gret_s ;;
  gret-t) gret_t ;;
  gret-u) gret_u ;;
  gret-v) gret_v ;;
  gret-w) gret_w ;;
  *) echo "usage: $0 study|ship|giga-vocab|gret-a|gret-b|gret-c|gret-d|gret-e|gret-f|gret-g|gret-h|gret-i|gret-j|gret-k|gret-l|gret-m|gret-n|gret-o|gret-p|gret-q|gret-r|gret-s|gret-t|gret-u|gret-v|gret-w" >&2; exit 2 ;;
esac
