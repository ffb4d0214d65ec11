"""labsupport: the code that the RLHF systems course's labs call.

Read it in this order: every module comes after the modules it imports. Three kinds of module:

- ``core/`` (about 350 lines): each mechanism in straight lines, the way vLLM's ``examples/rl`` read. This is
  the afternoon's reading, and the reference solutions of the graded assignments.
- the hardened mechanisms (top level): each imports its core module and adds what production needs; its
  docstring names every addition and the failure it guards against.
- ``course/`` (apparatus): what makes the labs run on this machine (results, hardware, the tiny model, engine
  start-up, timers). Skim it when a lab calls it; no chapter teaches it.

The apparatus the rest stands on:

- ``course.results``: reference results under results/, each with its machine, versions, command and date
- ``course.compare``: comparisons of measured values (rankings, closeness, shares) as phrases for the book
- ``course.progress``: progress on long work, the same in a terminal and in a notebook
- ``course.hardware``: what this machine has, and the one place that picks the GPU path or the CPU stand-in
- ``course.versions``: every difference between the vLLM and torch versions the course runs
- ``course.models``: the tiny language model and tokenizer, built and trained offline
- ``course.planner``: memory and transfer-time arithmetic for designs at scale
- ``course.memory_report``: reading memory numbers: a timeline's peaks, tables and plots
- ``course.ranks``: run a function on N ranks in fresh processes with a deadline

Memory (Chapter 2, Lab 2):

- ``core.timeline``: the short path of a memory timeline: bytes by role at phase edges, and a plot
- ``memory``: the core timeline plus allocator history, reserved bytes and optimizer state by role
- ``strategies``: one RLHF step under three memory strategies (keep, offload, drop and rebuild)

Weight sync over a process group (Chapters 4 and 6, Lab 3):

- ``core.buckets``: named tensors in one flat, aligned byte buffer, and back: what a bucket and a handle carry
- ``groups``: a process group that joins a trainer and inference workers without global state
- ``core.sync``: the short path of a weight sync: metadata, one broadcast per bucket, load
- ``metadata``: the one check of an update's names, dtypes and shapes against what a receiver holds
- ``checksums``: integer checksums of tensor bytes that every device agrees on
- ``broadcast``: ``core.sync`` plus a metadata vote, landing in place, double buffering and deadlines
- ``course.sync_timing``: a sync timed on a group you have, against bucket size

CUDA IPC (Chapter 5, Lab 5):

- ``core.handoff``: the short path of a CUDA IPC handoff: export, rebuild with device remap, load, release
- ``shm``: the /dev/shm files behind the CPU stand-in for CUDA IPC
- ``ipc``: ``core.handoff`` plus lifetimes by acknowledgement, exporter liveness, host and input checks
- ``course.peer``: a helper process that rebuilds handles, for the labs' two-process experiments
- ``course.ipc_timing``: an IPC update timed against plain copies of the same bytes

vLLM engines and their updates (Chapters 4 to 8, Labs 4, 6, 7, 8):

- ``vllm_weights``: what a vLLM worker does with received weights (checked, whole layers, then loaded)
- ``vllm_handles``: the IPC handles a co-located engine's workers look up, keyed by the GPU each runs on
- ``vllm_ext``: the weight-update protocol: worker extensions, calls with deadlines, errors that raise
- ``course.vllm_engine``: starting and stopping the labs' engines: arguments and environment in one place
- ``vllm_plugin``: vLLM's native weight-transfer API, and a gloo backend for it
- ``cluster``: Ray placement groups, and trainer and engine actors on GPU or CPU bundles
- ``course.cluster_labs``: the actors' call form without Ray on one GPU, and the CPU path's stand-ins
- ``reshard``: from a sharded (FSDP2) trainer to a tensor-parallel engine: layout, plan and their checks
- ``fast_update``: a co-located update at the copy floor: the trainer's weights mapped once, then a copy plan
- ``vllm_reshard``: resharding's transfers, three ways, and the engine side that receives shards
- ``lora``: LoRA-only updates: a trained adapter into vLLM, checked before the engine sees it

After the update, and the capstone (Chapters 9 and 11, Labs 9 and 10):

- ``rl.task``: the capstone's task: its prompts, held-out prompts and reward
- ``rl.rollout``: what an engine returns (completions with log-probabilities), the sampler, the held-out accuracy
- ``rl.grpo``: the GRPO loss with group advantages, and its TIS/MIS correction for a sampler that is not the trainer
- ``after_update``: what goes wrong once new weights are in: stale prefix cache, requests in flight, logprob gaps
- ``rl``: the capstone: a small GRPO loop in three orchestrations, side by side

Benchmarks live apart, in ``labsupport.bench``, one module per ``python -m labsupport bench`` command; mechanisms
and labs never import them. The command line is ``labsupport.__main__``. Every module imports without a GPU.
"""


__version__ = "0.1.0"
