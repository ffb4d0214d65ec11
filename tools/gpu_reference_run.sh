#!/usr/bin/env bash
# The course's reference GPU run: GPU-marked tests, benchmarks and the labs' GPU paths, on a machine
# with GPUs and no network (the lent H200/H100 machines). Results (JSON + PNG, each recording machine,
# versions, command and date) and logs are packed into $OUT for committing under results/.
#
#   bash tools/gpu_reference_run.sh [STEP ...]     # default: all steps; STEP in the list below
#   TESTS="tests/test_ipc.py" LABS="labs/lab_05_cuda_ipc.md" bash tools/gpu_reference_run.sh tests labs
#
# Without a venv: the wheels that machine lacks travel in .whl (../shared/device/pack-wheels.sh .whl), plus
# pytest-timeout, which the test steps use:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl pytest-timeout==2.4.0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT/results" "$OUT/logs"
if [ -d .whl ] && ! python3 -c "import ray, nbval" 2>/dev/null; then
  bash .whl/install-wheels.sh .whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LABSUPPORT_RESULTS_DIR=$OUT/results LABSUPPORT_CACHE=/tmp/labsupport_cache
export LABSUPPORT_RECORD_DIR=$OUT/results/notebooks  # each lab run is also saved, executed (conftest.py)
STEPS=${*:-doctor links sync ipc memory cluster tests labs rl}
run() {  # run NAME TIMEOUT CMD...: log to $OUT/logs/NAME.log, never stop the whole run
  local name=$1 limit=$2; shift 2
  echo "=== [$(date +%T)] $name: $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n 25 "$OUT/logs/$name.log"
  pack
}
pack() {  # keep $OUT small and complete even if a later step is killed: two archives, refreshed per step,
  # each written under a temporary name and then moved, so that tools/gpu_bg.sh never copies half of one
  tar czf "$OUT/results.tgz.tmp" -C "$OUT" results && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
  tar czf "$OUT/logs.tgz.tmp" -C "$OUT" logs && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"
}
TESTS=${TESTS:-tests}
LABS=${LABS:-labs/lab_01_environment.md labs/lab_02_memory_timeline.md labs/lab_03_nccl_weight_sync.md labs/lab_05_cuda_ipc.md labs/lab_10_capstone.md}
for step in $STEPS; do
  case $step in
    doctor)  run doctor 120 python3 -m labsupport doctor --save ;;
    links)   run links 120 python3 -m labsupport bench links ;;
    sync)    run sync 240 python3 -m labsupport bench sync --timeout 220 ;;
    ipc)     run ipc 180 python3 -m labsupport bench ipc ;;
    memory)  run memory 180 python3 -m labsupport bench memory ;;
    cluster) run cluster 180 python3 -m labsupport bench cluster ;;
    tests)   run tests 600 python3 -m pytest $TESTS -m gpu -v -rA --tb=short -p no:cacheprovider --timeout=90 --junitxml="$OUT/logs/gpu_tests.xml" ;;
    labs)    run labs 480 python3 -m pytest -v -p no:cacheprovider --timeout=300 $LABS --junitxml="$OUT/logs/gpu_labs.xml" ;;
    rl)      run rl 200 python3 -m labsupport rl --arch all ;;
    # with the CUDA vLLM kit (../shared/device/vllm-gpu.sh) installed and its env sourced:
    vllm_tests) run vllm_tests 600 python3 -m pytest tests/test_vllm_ext.py tests/test_rl.py -k "vllm or drop_in" -v -rA --tb=short -p no:cacheprovider --timeout=280 --junitxml="$OUT/logs/gpu_tests_vllm.xml" ;;
    vllm_bench) run vllm_bench 1200 python3 -m labsupport bench vllm-update ;;
    # one GPU: the co-located half of the bench, the GPU-capable vLLM test of the capstone, its co-located loop
    vllm_bench1) run vllm_bench1 540 python3 -m labsupport bench vllm-update ;;
    lora_bench) run lora_bench 300 python3 -m labsupport bench lora ;;
    vllm_tests1) run vllm_tests1 450 python3 -m pytest tests/test_vllm_lora.py tests/test_vllm_fast_update.py tests/test_rl.py::test_vllm_engine_logprobs_and_ipc_weight_update -v -rA --tb=short -p no:cacheprovider --timeout=280 --junitxml="$OUT/logs/gpu_tests_vllm1.xml" ;;
    labs1) run labs1 900 python3 -m pytest -v -p no:cacheprovider --timeout=300 labs/lab_01_environment.md labs/lab_02_memory_timeline.md labs/lab_05_cuda_ipc.md labs/lab_08_lora_updates.md --junitxml="$OUT/logs/gpu_labs_1_2_5_8.xml" ;;
    vllm_rl1) run vllm_rl1_test 270 python3 -m pytest tests/test_rl.py -k "vllm_engine_logprobs" -v -rA --tb=short -p no:cacheprovider --timeout=260 --junitxml="$OUT/logs/gpu_tests_vllm_rl1.xml"
              run vllm_rl1 300 python3 -m labsupport rl --arch colocated --engine vllm ;;
    # one GPU, vLLM kit: lab 6's one-GPU path, the capstone at 0.5B (results/capstone_colocated_vllm_0.5b.<machine>.json) and lab 10's 1-GPU path
    lab6gpu) run lab6gpu 400 python3 -m pytest -v -p no:cacheprovider --timeout=390 labs/lab_06_colocated_vllm.md --junitxml="$OUT/logs/gpu_lab06_colocated.xml" ;;
    # (every memory-saving switch on, as ch11's 0.5B section describes it; the fast defaults are bench peer's)
    rl05) run rl05 400 python3 -m labsupport rl --arch colocated --engine vllm --size 0.5b --config safe+offload+no-graphs ;;
    lab10gpu) run lab10gpu 1200 python3 -m pytest -v -p no:cacheprovider --timeout=580 labs/lab_10_capstone.md --junitxml="$OUT/logs/gpu_lab10_capstone.xml" ;;
    # 4 GPUs (nvidia-h200-x4), vLLM kit: FSDP2 on GPUs 0-1 -> vLLM TP=2 on GPUs 2-3 (results/bench_reshard.4xH200.json)
    vllm_reshard) run vllm_reshard 900 python3 -m labsupport bench reshard ${RESHARD_ARGS:-} ;;
    # 3 GPUs, vLLM kit: the NCCL modes at 7B (trainer GPU 0, TP=2 engine GPUs 1-2) beside the raw 3-rank broadcast,
    # the co-located modes and mapped_inline on GPU 0 (results/bench_vllm_update.<machine>.json)
    vllm_bench7) run vllm_bench7 720 python3 -m labsupport bench vllm-update --shapes 7b ;;
    # 2-4 GPUs, vLLM kit: the labs that need several GPUs (3: 3 GPUs, 4: 2, 7: 4), one junit and recording each
    lab3gpu) run lab3gpu 300 python3 -m pytest -v -p no:cacheprovider --timeout=290 labs/lab_03_nccl_weight_sync.md --junitxml="$OUT/logs/gpu_lab03_nccl.xml" ;;
    lab4gpu) run lab4gpu 560 python3 -m pytest -v -p no:cacheprovider --timeout=550 labs/lab_04_disaggregated_vllm.md --junitxml="$OUT/logs/gpu_lab04_disaggregated.xml" ;;
    lab4gpu2) run lab4gpu2 560 python3 -m pytest -v -p no:cacheprovider --timeout=550 labs/lab_04_disaggregated_vllm.md --junitxml="$OUT/logs/gpu_lab04_disaggregated_2gpu.xml" ;;
    labd1gpu) run labd1gpu 420 python3 -m pytest -v -p no:cacheprovider --timeout=400 labs/lab_d1_diagnose_sync.md --junitxml="$OUT/logs/gpu_labd1_diagnose_sync.xml" ;;
    # 4 GPUs, vLLM kit: lab 6's 4-GPU path (Ray, two TP=2 engines at 0.4 of each GPU beside four trainers: alone on
    # the machine, or its engines do not fit) and lab 10's multi-GPU orchestrations
    lab6gpu4) run lab6gpu4 900 python3 -m pytest -v -p no:cacheprovider --timeout=420 labs/lab_06_colocated_vllm.md --junitxml="$OUT/logs/gpu_lab06_colocated_4gpu.xml" ;;
    lab10gpu4) run lab10gpu4 900 python3 -m pytest -v -p no:cacheprovider --timeout=580 labs/lab_10_capstone.md --junitxml="$OUT/logs/gpu_lab10_capstone_4gpu.xml" ;;
    lab7gpu) run lab7gpu 560 python3 -m pytest -v -p no:cacheprovider --timeout=550 labs/lab_07_resharding.md --junitxml="$OUT/logs/gpu_lab07_resharding.xml" ;;
    # one GPU, vLLM kit: lab 9's one-GPU path, and the FP8 engine's update (results/bench_fp8_update.<machine>.json, read by lab 9 and ch09)
    lab9gpu) run lab9gpu 400 python3 -m pytest -v -p no:cacheprovider --timeout=390 labs/lab_09_after_the_update.md --junitxml="$OUT/logs/gpu_lab09_after_update.xml" ;;
    fp8) run fp8 400 python3 -m labsupport bench fp8-update ;;
    # any GPUs, vLLM kit: the fault table (results/faults.<machine>.json, book/faults.md); rows needing more GPUs skip
    faults) run faults ${FAULTS_LIMIT:-900} python3 -m labsupport bench faults --device cuda ${FAULTS_ARGS:-} ;;
    rl_tis) run rl_tis 400 python3 -m labsupport rl --arch colocated --engine vllm --size 0.5b --correction tis ;;  # bf16 engine vs fp32 trainer
    # one GPU, vLLM kit + TRL's wheels (.whl): the capstone against TRL's GRPOTrainer (results/bench_peer.<machine>.json):
    # per seed (0,1) TRL and the capstone's default configuration, then the ablations on seed 0 (--capstone-configs);
    # both trainers in bf16 autocast over fp32 master weights (--precision fp32 for the fp32 comparison)
    # (about 20 min: start it with tools/gpu_bg.sh start peer)
    peer) run peer 2700 python3 -m labsupport bench peer --timeout 900 ${PEER_ARGS:-} ;;
    # 4 GPUs (nvidia-h200-x4) as two lanes of 2, vLLM kit + TRL's wheels (.whl, as for peer): the three architectures
    # and the capstone's disaggregated/async loops against TRL's server mode and AsyncGRPOTrainer, seeds 0 and 1
    # (results/bench_peer2.<machine>.json; about 20-25 min: start it with tools/gpu_bg.sh start peer2)
    peer2) run peer2 1750 python3 -m labsupport bench peer2 --gpus 4 --timeout 600 ${PEER2_ARGS:-} ;;
    # one GPU, vLLM kit: the diagnosis labs' every variant on the GPU path, and the grader (reference, stubs, seeded bugs)
    diag1) run diag1 560 python3 -m pytest tests/test_diagnosis.py -m gpu -v -rA -p no:cacheprovider --timeout=540 --junitxml="$OUT/results/gpu_diagnosis.xml" ;;
    grade1) run grade1 590 python3 -m grading --impl reference,stubs,bugs --save grade_gpu ;;
    # make grade's GPU targets (grading/targets.py) and leaderboard records: the reference, and a seeded bug that
    # sends tensor by tensor (it passes on a CPU; the target is what it misses)
    grade_ref) for impl in reference a3_per_tensor; do
        run grade_ref_$impl 300 python3 -m grading --impl $impl --record "$OUT/results/grade_record.$impl.json"; done ;;
    # one GPU, vLLM kit: the capstone's crash on fresh machines, reproduced (tools/repro_cublas_workspace.py), and
    # the soak of fresh capstone runs (results/bench_soak*.<machine>.json; SOAK_ARGS: bench soak's arguments)
    repro_torch) run repro_torch 300 python3 tools/repro_cublas_workspace.py torch ;;
    repro_vllm) run repro_vllm 600 python3 tools/repro_cublas_workspace.py vllm ;;
    ipc_tests) run ipc_tests 240 python3 -m pytest tests/test_ipc.py -m gpu -v -rA --tb=short -p no:cacheprovider --timeout=120 --junitxml="$OUT/logs/gpu_tests_ipc.xml" ;;
    soak) run soak 1700 python3 -m labsupport bench soak ${SOAK_ARGS:-} ;;
    *) echo "unknown step $step" ;;
  esac
done
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$OUT/logs/nvidia-smi.csv" 2>&1
pack && rm -rf "$OUT/results" "$OUT/logs"
ls -la "$OUT"
