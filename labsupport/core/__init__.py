"""The short path: each of the course's mechanisms in straight lines, read before the hardened
modules.

Read them in this order (about 450 lines together; they import nothing outside ``core/`` but torch);
each lab runs its core first, then the hardened module:

- ``devices``: a GPU's identity (its UUID), a wait for its queue, where a CUDA IPC handle keeps its
  device
- ``buckets``: named tensors laid out in one flat byte buffer, and the buffer sliced back into them
- ``sync``: NCCL weight sync: metadata, then one broadcast per bucket, then load (Lab 3, then
  ``broadcast``)
- ``handoff``: CUDA IPC: export, rebuild with device remap, load, release (Lab 5, then ``ipc``)
- ``colocated``: the co-located update: one bucket in the engine's dtype, loaded or copied between
  sleep and wake (Lab 6, then ``fast_update`` and ``vllm_ext``)
- ``timeline``: a memory timeline: record bytes by role at phase edges, and plot them (Lab 2, then
  ``memory``)

They run on both kinds of machine with one code path: a tensor on a GPU goes through NCCL or CUDA
IPC, a tensor on the CPU through gloo or a shared-memory file in ``/dev/shm``.
"""
