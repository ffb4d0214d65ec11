"""labsupport: the code that the RLHF systems course's labs call.

One module per mechanism the book teaches (see the API reference page):
hardware, results, models, groups, broadcast, ipc, memory, planner, vllm_ext, cluster, rl.
Every module imports without a GPU; the backend (NCCL/CUDA or gloo/shared memory) is chosen at run time.
"""

__version__ = "0.1.0"
