#!/usr/bin/env bash
# Run tools/gpu_reference_run.sh in the background on a lent GPU machine, so that a run longer than one
# device call (10 min) spans several back-to-back calls; each call collects what has finished so far.
#
#   bash tools/gpu_bg.sh start STEP ...   # starts the steps in a new process session (outlives the call)
#   bash tools/gpu_bg.sh wait SECONDS     # waits until every lane ends or SECONDS pass; copies archives to $OUT
#
# Lanes: on a machine with several GPUs, independent one-GPU steps can run side by side, one lane per GPU:
#   LANE=a GPUS=0 bash tools/gpu_bg.sh start peer; LANE=b GPUS=1 bash tools/gpu_bg.sh start labs1 lab6gpu
# Each lane runs in its own copy of the tree with CUDA_VISIBLE_DEVICES=$GPUS; `wait` waits for all of them and
# copies each lane's two archives (results-LANE.tgz, logs-LANE.tgz). Without LANE there is one lane, "main".
# AFTER=lane makes a lane start its steps once that lane has finished (GPUs a first lane uses, then handed on):
#   LANE=f GPUS=1,2,3 ... start faults; LANE=p GPUS=1,2 AFTER=f ... start peer
# AFTER may name several lanes (AFTER="v s"): the lane starts once all of them have finished.
#
# The machine must not go idle for 30 s between calls, or it is given back with the run. Each lane works in a
# copy of the tree (/tmp/gpu_bg/LANE/tree): each call re-sends the carried tree, which would pull a running
# lab's current folder from under it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=/tmp/gpu_bg
LANE=${LANE:-main}
BG=$ROOT/$LANE
case ${1:-} in
  start)
    shift
    rm -rf "$BG" && mkdir -p "$BG/out" "$BG/tree"
    tar --exclude=./.git --exclude=./.venv --exclude="./.vk*" -cf - . | tar -xf - -C "$BG/tree"
    export PYTHONPATH=$BG/tree${PYTHONPATH:+:$PYTHONPATH}
    [ -n "${GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=$GPUS
    first=""  # AFTER="a b": wait until each of those lanes has finished
    for after in ${AFTER:-}; do first+="while [ ! -e $ROOT/$after/DONE ]; do sleep 5; done; "; done
    setsid nohup bash -c "${first}cd $BG/tree && OUT=$BG/out bash tools/gpu_reference_run.sh $* > $BG/run.log 2>&1; touch $BG/DONE" \
      > /dev/null 2>&1 < /dev/null &
    echo "started lane $LANE (GPUs ${GPUS:-all}): $*" ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ]; do
      busy=0; for d in "$ROOT"/*/; do [ -e "$d/DONE" ] || busy=1; done
      [ $busy = 0 ] && break; sleep 5
    done
    for d in "$ROOT"/*/; do
      lane=$(basename "$d")
      for a in results logs; do cp "$d/out/$a.tgz" "${OUT:-/tmp}/$a-$lane.tgz" 2>/dev/null; done
      echo "--- lane $lane"; grep "^===" "$d/run.log"
      if [ -e "$d/DONE" ]; then echo "lane $lane finished"; else
        echo "lane $lane still running"; log=$(ls -t "$d"/out/logs/*.log 2>/dev/null | head -1)
        [ -n "$log" ] && { echo "  tail of $log:"; tail -n 4 "$log" | cut -c1-300; }
      fi
    done ;;
  *) echo "usage: [LANE=name GPUS=ids] $0 start STEP ... | wait SECONDS" >&2; exit 2 ;;
esac
