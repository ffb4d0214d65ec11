"""The short path: each of the course's three mechanisms in straight lines, read before the hardened modules.

Read them in this order (about 300 lines together); each lab runs its core first, then the hardened module:

- ``buckets``: named tensors laid out in one flat byte buffer, and the buffer sliced back into them
- ``sync``: NCCL weight sync: metadata, then one broadcast per bucket, then load (Lab 3, then ``broadcast``)
- ``handoff``: CUDA IPC: export, rebuild with device remap, load, release (Lab 5, then ``ipc``)
- ``timeline``: a memory timeline: record bytes by role at phase edges, and plot them (Lab 2, then ``memory``)

They run on both kinds of machine with one code path: a tensor on a GPU goes through NCCL or CUDA IPC, a tensor
on the CPU through gloo or a shared-memory file in ``/dev/shm``.
"""
