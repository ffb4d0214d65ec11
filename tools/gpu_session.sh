#!/usr/bin/env bash
# Issues 46 and 47's GPU measurements on ONE nvidia-h200-x4 machine, as lanes of tools/gpu_bg.sh chained with AFTER=,
# started by one call and collected by later ones. Ordered by value; each lane has its GPUs to itself while it runs
# where a number depends on it (the fault table reads memory on every GPU it sees; the benches time transfers).
#
#   lane GPUs     after      steps (tools/gpu_reference_run.sh)           what it makes
#   f    0-3      -          faults          (limit FAULTS_LIMIT=960 s)   (a) results/faults.4xH200.json, every row
#   v    0-3      f          vllm_bench7     (720 s)                      (b) bench_vllm_update.4xH200.json: NCCL modes
#                                                                             at 7B, trainer GPU 0, TP=2 on GPUs 1-2,
#                                                                             raw 3-rank broadcast, co-located and
#                                                                             mapped_inline on GPU 0 (GPU 3 is seen,
#                                                                             for the tag, and left to lane s)
#   s    3        f          soak (SOAK_A: 2 runs of fastest, 1 cold)     (e) bench_soak-s.1xH200.json (one GPU seen)
#   r    0-3      v s        vllm_reshard    (900 s)                      (c) bench_reshard.4xH200.json, 1.5B and 7B
#   la   0,1,2    r          lab3gpu labd1gpu lab4gpu                      (d) junit + recordings (3 GPUs)
#   lc   0,1      la         lab4gpu2                                      (d) lab 4's TP=1 path (2 GPUs)
#   lb   0-3      la lc      lab7gpu lab10gpu4                             (d) (4 GPUs)
# (the lab lanes take turns: lab 7 hung in its first FSDP step when it shared GPUs 0-2 with lane la's labs)
#   l6   0-3      la lb lc   lab6gpu4        (900 s; cells 420 s)         (d) lab 6's 4-GPU path, alone (Ray, two
#                                                                             TP=2 engines at 0.4 of every GPU)
#   s2   0-3      l6         soak (SOAK_B)                                (e) bench_soak-s2.4xH200.json
#   g    0,1      f          grade_ref                                    (g) make grade's GPU targets and leaderboard
#                                                                             records: the reference and a seeded bug
#   g1   3        f          grade1                                       (g) the grader's sweep (reference, stubs,
#                                                                             seeded bugs) with its GPU tests
# `start grade+47` = g g1 v r la lb lc l6: issue 45's targets and issue 47's runs in one machine's half hour (about
# 25 min: g 7, v 4, r 5, labs, lab 6), faults and soaks left for another. Measured 2026-11-28: g 297 s + 108 s
# (every graded test, GPU ones included, then the targets), g1 287 s, v 211 s, r 292 s (1.5B; 7B cut), la 230 s,
# lc 119 s: the labs then ran past the budget. `start rest47` = v r lb l6: what issue 47 still needs (about 22 min);
# since 2026-11-29 Lab 4's recordings are stale too (its clean-up check), so a second machine: `start la lc`;
# issue 46's faults and soaks, then issue 48's peer2, each want a machine's half hour of their own:
# `start f soak46` (issue 46's rest, about 24 min: the fault table, then per GPU a cold and a warm
# run of fastest (SOAK_Q), then fast on GPU 0 and safe on GPU 1; merge: bench soak --merge
# results/bench_soak.4xH200.json q*/bench_soak-q*.json --machine-tag 4xH200; since 2026-11-29 the soaks
# meet every goal, so `start f` alone does: the whole fault table on four GPUs), and on
# nvidia-h200-x2 `P2_SEEDS=0 start p2` (about 20 min a seed), or on x4 `PEER2_GPUS=4 start p2`
# (two lanes of two GPUs: each pair's capstone and TRL runs side by side).
#
# Expected wall time from `start` (fresh machine, cold compile caches; from the 4xH200 logs in results/logs): f 10-12
# min (a cold tiny engine 150-180 s, three TP=2 engines, ~25 rows); v 5-6 (7B: three engine starts); r 4-6; labs
# ~6 (lab 10: 343 s) then lab 6 3-5; so (a)-(c) end near 22 min, the labs near 32. One machine is held at most 30 min,
# staging included: in one session expect (a), (b), (c) and the soak lane s; the labs need the next machine
# (`start labs`). FAULTS_GPUS=0,1,2 frees GPU 3 during the fault table (lane s then starts at once, with more runs:
# SOAK_A), at the price of the table's tag (faults.3xH200.json: three GPUs seen, all a row needs).
#
# The device calls (each `run` with kind nvidia-h200-x4; back to back, nothing slow in between, the machine is given
# back ~30 s after a call ends). Before: ../shared/device/build-vllm-kit.sh made .vk1 .. .vk4 in the checkout.
#   1-4. carry [".vk1"]: bash .vk1/vllm-gpu.sh stage            (then .vk2, .vk3, .vk4: one part per call)
#   5.   bash /tmp/vk/vllm-gpu.sh install && . /tmp/vk/vllm-gpu.sh env && bash tools/gpu_session.sh start
#   6..  . /tmp/vk/vllm-gpu.sh env && bash tools/gpu_session.sh wait 560    (repeat; each returns what has finished,
#        in at most 8 files under $OUT: results.tgz, logs.tgz, status.txt; timeout_s 600)
#   last bash tools/gpu_session.sh collect                         (anything a lane left, at once)
# If a reply says the machine was not warm, it is a new one: the lanes are gone; stage again and `start` the rest
# (`start labs`, or `start LANE ...`).
#
#   bash tools/gpu_session.sh start [all|labs|LANE ...]   # default all
#   bash tools/gpu_session.sh wait SECONDS                # until every lane ends or SECONDS pass, then collect
#   bash tools/gpu_session.sh collect                     # $OUT/results.tgz, logs.tgz, status.txt
#   DRY=1 bash tools/gpu_session.sh start ...             # print the lanes it would start
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=/tmp/gpu_bg
FAULTS_GPUS=${FAULTS_GPUS:-0,1,2,3}
if [ "$FAULTS_GPUS" = 0,1,2,3 ]; then S_AFTER=f; SOAK_A=${SOAK_A:---configs fastest --runs 2 --cold 1 --steps 30}
else S_AFTER=; SOAK_A=${SOAK_A:---configs fastest --runs 5 --cold 2 --steps 30}; fi
SOAK_B=${SOAK_B:---configs fastest,fast,safe,fastest+inline --runs 2 --cold 1 --steps 30}

lane() {  # lane NAME GPUS AFTER STEP...: one lane of tools/gpu_bg.sh (DRY=1: print it only)
  local name=$1 gpus=$2 after=$3; shift 3
  if [ -n "${DRY:-}" ]; then
    echo "LANE=$name GPUS=$gpus AFTER='$after' FAULTS_LIMIT=${FAULTS_LIMIT:-} SOAK_ARGS='${SOAK_ARGS:-}' start $*"; return
  fi
  LANE=$name GPUS=$gpus AFTER=$after bash tools/gpu_bg.sh start "$@"
}

start() {
  local what=${*:-all}
  case " $what " in *" all "*) what="f v s r la lb lc l6 s2" ;; esac
  case " $what " in *" labs "*) what="${what/labs/la lb lc l6 s2}" ;; esac
  case " $what " in *" grade+47 "*) what="${what/grade+47/g g1 v r la lb lc l6}" ;; esac
  case " $what " in *" rest47 "*) what="${what/rest47/v r lb l6}" ;; esac
  case " $what " in *" soak46 "*) what="${what/soak46/q0 q1 q2 q3 q4 q5}" ;; esac
  case " $what " in *" one "*) what="${what/one/v1 f1 o}" ;; esac
  case " $what " in *" soak1 "*) what="${what/soak1/t f1 o}" ;; esac
  case " $what " in *" soak2 "*) what="${what/soak2/o p o2}" ;; esac
  has() { case " $what " in *" $1 "*) return 0 ;; esac; return 1; }
  # (a later lane waits only for lanes started now: one that is not there is not waited for)
  after() { local out=""; for l in "$@"; do has "$l" && out+="$l "; done; echo "$out"; }
  has f && FAULTS_LIMIT=${FAULTS_LIMIT:-960} lane f "$FAULTS_GPUS" "" faults
  has g && lane g 0,1 "$(after f)" grade_ref
  has g1 && lane g1 3 "$(after f)" grade1
  has v && lane v 0,1,2,3 "$(after f g)" vllm_bench7
  has s && SOAK_ARGS="$SOAK_A --tag s" lane s 3 "$(after $S_AFTER)" soak
  has r && lane r 0,1,2,3 "$(after v s g1)" vllm_reshard
  has la && lane la 0,1,2 "$(after r)" lab3gpu labd1gpu lab4gpu
  has lc && lane lc 0,1 "$(after r la)" lab4gpu2
  has lb && lane lb 0,1,2,3 "$(after r la lc)" lab7gpu lab10gpu4
  has l6 && lane l6 0,1,2,3 "$(after la lb lc)" lab6gpu4
  has s2 && SOAK_ARGS="$SOAK_B --tag s2" lane s2 0,1,2,3 "$(after l6)" soak
  for g in 0 1 2 3; do  # soak46: what the H200 soaks lacked (fastest 16 of 24 runs, 5 of 8 cold;
    # fast and safe 3 of 4 each; met on 2026-11-29, fastest 32 runs, 8 cold): one lane per GPU, then
    # fast and safe
    has q$g && SOAK_ARGS="${SOAK_Q:---configs fastest --runs 2 --cold 1 --steps 30} --tag q$g" \
      lane q$g $g "$(after f)" soak
  done
  has q4 && SOAK_ARGS="--configs fast --runs 1 --cold 0 --steps 30 --tag q4" lane q4 0 q0 soak
  has q5 && SOAK_ARGS="--configs safe --runs 1 --cold 0 --steps 30 --tag q5" lane q5 1 q1 soak
  # one (nvidia-h200, one GPU, in turn): the 7B co-located update against its floor (v1), the fault table's
  # one-GPU rows (f1: results/faults.1xH200.json), then cold and warm runs of fastest (o)
  # soak1 (the same machine, later): the IPC module's GPU tests (t), f1, then o: its record is rewritten as
  # each run ends, so a soak cut short by the machine's half hour keeps the runs that finished
  has v1 && lane v1 0 "" vllm_bench7
  has t && lane t 0 "$(after v1)" ipc_tests
  has f1 && FAULTS_LIMIT=${FAULTS_LIMIT:-900} lane f1 0 "$(after v1 t)" faults
  has o && SOAK_ARGS="${SOAK_O:---configs fastest --runs 4 --cold 2 --steps 30} --tag o" lane o 0 "$(after v1 t f1)" soak
  # soak2 (one GPU, what the H200 soaks still lack): cold runs of fastest first (SOAK_O), then fast and
  # safe once each with the caches those left (p), then warm runs of fastest until the half hour ends (o2).
  has p && SOAK_ARGS="--configs fast,safe --runs 1 --cold 0 --steps 30 --tag p" lane p 0 "$(after o)" soak
  has o2 && SOAK_ARGS="--configs fastest --runs 6 --cold 0 --steps 30 --tag o2" lane o2 0 "$(after o p)" soak
  # p2: bench peer2 on 2 GPUs (nvidia-h200-x2), one seed per half hour (P2_SEEDS); TRL's wheels
  # installed first (.whl, carried); later: bench peer2 --summarize A.json B.json, one record
  has p2 && PEER2_ARGS="--gpus ${PEER2_GPUS:-2} --seeds ${P2_SEEDS:-0}" \
    lane p2 "$(seq -s, 0 $((${PEER2_GPUS:-2} - 1)))" "" peer2
  return 0
}

collect() {  # every lane's archives, unpacked and packed again as two files, and a status page: 3 files in $OUT
  local out=${OUT:-/tmp/gpu_out} tmp=/tmp/gpu_collect
  rm -rf "$tmp" && mkdir -p "$tmp/results" "$tmp/logs" "$out"
  {
    echo "collected $(date -u +%FT%TZ)"
    for d in "$ROOT"/*/; do
      [ -d "$d" ] || continue
      l=$(basename "$d")
      for a in results logs; do
        mkdir -p "$tmp/x/$l" && tar xzf "$d/out/$a.tgz" -C "$tmp/x/$l" 2>/dev/null
        # a lane still running has no archive yet past its first step's end: take its folder as it is now
        [ -d "$d/out/$a" ] && cp -r "$d/out/$a" "$tmp/x/$l/" 2>/dev/null
      done
      for a in results logs; do  # lane-prefixed where names could clash (logs/soak-*.log, notebooks)
        [ -d "$tmp/x/$l/$a" ] && (cd "$tmp/x/$l/$a" && find . -type f | while read -r f; do
          mkdir -p "$tmp/$a/$l/$(dirname "$f")" && cp "$f" "$tmp/$a/$l/$f"; done)
      done
      if [ -e "$d/DONE" ]; then echo "--- lane $l: finished"; else echo "--- lane $l: running"; fi
      grep "^===" "$d/run.log" 2>/dev/null
    done
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv 2>&1 | head -6
  } > "$out/status.txt"
  tar czf "$out/results.tgz" -C "$tmp" results && tar czf "$out/logs.tgz" -C "$tmp" logs
  cat "$out/status.txt"; ls -la "$out"
}

case ${1:-} in
  start) shift; start "$@" ;;
  wait) mkdir -p /tmp/gpu_bg_copies && OUT=/tmp/gpu_bg_copies bash tools/gpu_bg.sh wait "${2:-500}" > /dev/null; collect ;;
  collect) collect ;;
  *) echo "usage: $0 start [all|labs|LANE ...] | wait SECONDS | collect" >&2; exit 2 ;;
esac
