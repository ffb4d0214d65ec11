"""labsupport: the code that the RLHF systems course's labs call.

The modules, in the order the chapters use them (read them in this order; the API page has each one). Each
mechanism comes twice: first its straight-line core in ``labsupport.core`` (about 300 lines for all three, the
part a lab runs first), then the hardened module, which adds what production needs (each lab lists the
additions and the failures they guard against):

- ``course.hardware``: what this machine has (GPUs, links and their measured bandwidth, CUDA IPC), and the one place that
  picks GPU or CPU stand-in; ``require`` stops with one line naming a package that is not installed
- ``course.results``: reference results under results/, each with its machine, versions, command and date
- ``course.progress``: progress on long work (tqdm bars, what an engine's start waits for, a live plot), the same in a
  terminal and in a notebook; ``LABSUPPORT_PROGRESS=0`` turns it off
- ``course.models``: the tiny language model and tokenizer, built and trained offline, whose output a sync visibly changes
- ``core.timeline``: the short path of a memory timeline: bytes by role at phase edges, and a plot (Lab 2)
- ``memory``: a memory timeline of an RLHF step, with bytes by role (weights, grads, optimizer, KV cache)
- ``strategies``: the same step under three memory strategies (keep, offload, drop and rebuild), and what a
  timeline costs it
- ``course.planner``: memory and transfer-time arithmetic for designs at scale (ZeRO, KV cache, links)
- ``groups``: a process group that joins a trainer and inference workers without global state
- ``course.ranks``: run a function on N ranks in fresh processes with a deadline (the tests' and benchmarks' launcher)
- ``core.buckets``: named tensors in one flat byte buffer (what a bucket and an IPC handle carry)
- ``core.sync``: the short path of a weight sync: metadata, one broadcast per bucket, load (Lab 3)
- ``broadcast``: weight sync over that group: metadata first, then per-tensor or bucketed broadcasts
- ``metadata``: the one check of an update's names, dtypes and shapes against what a receiver holds
- ``checksums``: the optional end-to-end check of a broadcast
- ``course.sync_timing``: a sync timed on a group you have: raw, per-tensor and bucketed, against bucket size (Lab 3)
- ``core.handoff``: the short path of a CUDA IPC handoff: export, rebuild with device remap, load, release (Lab 5)
- ``ipc``: CUDA IPC handles (shared memory on CPU): export, rebuild in another process, lifetimes
- ``shm``: the /dev/shm files behind the CPU stand-in for CUDA IPC
- ``course.peer``: a helper process that rebuilds handles, for the labs' two-process experiments
- ``course.ipc_timing``: an IPC update timed against plain copies of the same bytes, on a realistic state (Lab 5)
- ``vllm_weights``: what a vLLM worker does with received weights (checked, whole layers, then loaded)
- ``vllm_ext``: vLLM worker extensions and the trainer's side of a weight update
- ``fast_update``: a co-located update at the copy floor: the trainer's weights mapped once, then a copy plan
- ``course.versions``: every difference between the vLLM and torch versions the course runs (0.26 on GPUs, 0.32 in CI)
- ``vllm_plugin``: vLLM's native weight-transfer API over gloo, registered as a vLLM plugin
- ``cluster``: Ray placement groups, and trainer and engine actors on GPU or CPU bundles
- ``reshard``: from a sharded (FSDP2) trainer to a tensor-parallel engine: name/layout mapping, plan, three ways
- ``vllm_reshard``: the engine side of resharding, a worker extension that receives shards into fused TP weights
- ``lora``: LoRA-only updates: a trained adapter into vLLM, against a full update of the merged weights
- ``after_update``: what goes wrong once new weights are in: stale prefix cache, requests in flight, logprob mismatch
- ``rl``: the capstone: a small GRPO loop in three orchestrations, side by side

Benchmarks live apart, in ``labsupport.bench``, one module per ``python -m labsupport bench`` command; mechanisms
and labs never import them (what a lab measures here and now is in the modules above). The command line is
``labsupport.__main__``. Every module imports without a GPU.
"""

__version__ = "0.1.0"
