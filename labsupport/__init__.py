"""labsupport: the code that the RLHF systems course's labs call.

Read it in this order: every module comes after the modules it imports. Five layers, each standing
only on the layers above it in this list (``tests/test_package_shape.py`` computes them from the
list below):

- ``core/`` (about 450 lines), the root: each mechanism in straight lines, the way vLLM's
  ``examples/rl`` read, on nothing but torch. This is the afternoon's reading, and the reference
  solutions of the graded assignments.
- ``course/`` (apparatus): what makes the labs run on this machine (results, hardware, the tiny
  model, engine start-up, fresh processes). Skim it when a lab calls it; no chapter teaches it.
- the hardened mechanisms (top level): each imports its core module and adds what production needs;
  its docstring names every addition and the failure it guards against.
- ``rl/``: the capstone, a small GRPO loop in three orchestrations, built on the mechanisms.
- ``experiments/``: what drives the labs' experiments (timers, stand-ins, probes, reports), read
  last.

The core, the short path (Chapters 2 to 5; Assignments 1 to 5):

- ``core.devices``: a GPU's identity, a wait for its queue, where a CUDA IPC handle keeps its device
- ``core.timeline``: a memory timeline: bytes by role at phase edges, and a plot
- ``core.buckets``: named tensors in one flat, aligned byte buffer, and back: what a bucket and a
  handle carry
- ``core.sync``: a weight sync over a process group: metadata, one broadcast per bucket, load
- ``core.handoff``: a CUDA IPC handoff: export, rebuild with device remap, load, release
- ``core.colocated``: the co-located update: one bucket in the engine's dtype, loaded or copied,
  sleep and wake

The apparatus the mechanisms stand on (it stands on the core alone):

- ``course.results``: reference results under results/, each with its machine, versions, command and
  date
- ``course.compare``: comparisons of measured values (rankings, closeness, shares) as phrases for
  the book
- ``course.progress``: progress on long work, the same in a terminal and in a notebook
- ``course.hardware``: what this machine has, and the one place that picks the GPU path or the CPU
  stand-in
- ``course.versions``: every difference between the vLLM and torch versions the course runs
- ``course.models``: the tiny language model and tokenizer, built and trained offline
- ``course.planner``: memory and transfer-time arithmetic for designs at scale
- ``course.ranks``: run a function on N ranks in fresh processes with a deadline
- ``course.peer``: a second process to talk to, with deadlines (Lab 5's probes, the capstone's
  engine process)
- ``course.vllm_engine``: starting and stopping the labs' engines: arguments and environment in one
  place

Memory (Chapter 2, Lab 2):

- ``memory``: the core timeline plus allocator history, reserved bytes and optimizer state by role

Weight sync over a process group (Chapters 4 and 6, Lab 3):

- ``groups``: a process group that joins a trainer and inference workers without global state
- ``metadata``: the one check of an update's names, dtypes and shapes against what a receiver holds
- ``checksums``: integer checksums of tensor bytes that every device agrees on
- ``broadcast``: ``core.sync`` plus a metadata vote, landing in place, double buffering and
  deadlines

CUDA IPC (Chapter 5, Lab 5):

- ``shm``: the /dev/shm files behind the CPU stand-in for CUDA IPC
- ``ipc``: ``core.handoff`` plus lifetimes by acknowledgement, exporter liveness, host and input
  checks

vLLM engines and their updates (Chapters 4 to 8, Labs 4, 6, 7, 8):

- ``vllm_weights``: what a vLLM worker does with received weights (checked, whole layers, then
  loaded)
- ``vllm_handles``: the IPC buckets a trainer packs for a co-located engine, keyed by the GPU each
  worker runs on, and the lookup that finds a worker's own
- ``reshard``: from a sharded (FSDP2) trainer to a tensor-parallel engine: layout, plan and their
  checks
- ``vllm_plan``: copy plans into a worker's parameters, checked once; the bucketed receive that only
  copies
- ``vllm_ext``: the weight-update protocol: worker extensions, calls with deadlines, errors that
  raise
- ``vllm_plugin``: vLLM's native weight-transfer API, and a gloo backend for it
- ``fast_update``: ``core.colocated``'s mapped path at the copy floor: the trainer's bucket, a
  checked copy plan
- ``vllm_reshard``: resharding shard to shard: the trainer ranks' sends, the engine side that
  receives them
- ``lora``: LoRA-only updates: a trained adapter into vLLM, checked before the engine sees it

The capstone (Chapter 11, Lab 10):

- ``rl.task``: the capstone's task: its prompts, held-out prompts and reward
- ``rl.rollout``: what an engine returns (completions with log-probabilities), the sampler, the
  held-out accuracy
- ``rl.grpo``: the GRPO loss with group advantages, and its TIS/MIS correction for a sampler that is
  not the trainer
- ``rl``: the capstone: a small GRPO loop in three orchestrations, side by side

The labs' experiments, read last:

- ``experiments.memory_report``: reading memory numbers: a timeline's peaks, tables and plots
- ``experiments.strategies``: one RLHF step under three memory strategies (keep, offload, drop and
  rebuild)
- ``experiments.sync_timing``: a sync timed on a group you have, against bucket size
- ``experiments.sharing``: what a second process sees of an exported handle (Lab 5's proof that
  nothing is copied)
- ``experiments.ipc_timing``: an IPC update timed against plain copies of the same bytes
- ``experiments.cluster``: Ray placement groups, and trainer and engine actors on GPU or CPU bundles
- ``experiments.cluster_labs``: the actors' call form without Ray on one GPU, and the CPU path's
  stand-ins
- ``experiments.reshard_gather``: Lab 7's gather modes (all at once, or a bucket while the last is
  on the wire), the baselines of shard to shard
- ``experiments.lora_demo``: Lab 8's LoRA demo: its base model, training, greedy text, each update
  timed
- ``experiments.after_update``: what goes wrong once new weights are in: stale prefix cache,
  requests in flight, logprob gaps (Chapter 9, Lab 9)

Benchmarks live apart, in ``labsupport.bench``, one module per ``python -m labsupport bench``
command; nothing else in the package imports them. The command line is ``labsupport.__main__``.
Every module imports without a GPU.
"""


__version__ = "0.1.0"
