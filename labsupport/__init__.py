"""labsupport: the code that the RLHF systems course's labs call.

One module per mechanism the book teaches, in the order the chapters use them (see the API reference page):
hardware, results, models, memory, strategies, planner, groups, broadcast, ipc (with shm and peer),
vllm_ext (with vllm_plugin), reshard, cluster, rl. Benchmarks live apart, in ``labsupport.bench``, one module per
``python -m labsupport bench`` command; mechanisms never import them.
Every module imports without a GPU; the backend (NCCL/CUDA or gloo/shared memory) is chosen at run time.
"""

__version__ = "0.1.0"
