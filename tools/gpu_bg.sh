#!/usr/bin/env bash
# Run tools/gpu_reference_run.sh in the background on a lent GPU machine, so that a run longer than one
# device call (10 min) spans several back-to-back calls; each call collects what has finished so far.
#
#   bash tools/gpu_bg.sh start STEP ...   # starts the steps in a new process session (outlives the call)
#   bash tools/gpu_bg.sh wait SECONDS     # waits until the run ends or SECONDS pass; copies its archives to $OUT
#
# The machine must not go idle for 30 s between calls, or it is given back with the run. The run works in a copy
# of the tree (/tmp/gpu_bg/tree): each call re-sends the carried tree, which would pull a running lab's current
# folder from under it.
set -uo pipefail
cd "$(dirname "$0")/.."
BG=/tmp/gpu_bg
case ${1:-} in
  start)
    shift
    rm -rf "$BG" && mkdir -p "$BG/out" "$BG/tree"
    tar --exclude=./.git --exclude=./.venv --exclude="./.vk*" -cf - . | tar -xf - -C "$BG/tree"
    export PYTHONPATH=$BG/tree${PYTHONPATH:+:$PYTHONPATH}
    setsid nohup bash -c "cd $BG/tree && OUT=$BG/out bash tools/gpu_reference_run.sh $* > $BG/run.log 2>&1; touch $BG/DONE" \
      > /dev/null 2>&1 < /dev/null &
    echo "started: $*" ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ ! -e "$BG/DONE" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    cp "$BG"/out/*.tgz "${OUT:-/tmp}/" 2>/dev/null
    cp "$BG/run.log" "${OUT:-/tmp}/bg_run.log"
    grep "^===" "$BG/run.log"
    if [ -e "$BG/DONE" ]; then echo "run finished"; else echo "still running"; fi ;;
  *) echo "usage: $0 start STEP ... | wait SECONDS" >&2; exit 2 ;;
esac
