"""The short path: each of the course's mechanisms in straight lines, read before the hardened
modules. Read them in this order (about 500 lines; they import nothing outside ``core/`` but torch);
each lab runs its core first, then the hardened module:

- ``devices``: a GPU's identity (its UUID), a wait for its queue, a CUDA IPC handle's device slot
- ``buckets``: named tensors laid out in one flat byte buffer, and the buffer sliced back into them
- ``sync``: NCCL weight sync: metadata, one broadcast per bucket, load (Lab 3, then ``broadcast``)
- ``handoff``: CUDA IPC: export, rebuild with device remap, load, release (Lab 5, then ``ipc``)
- ``colocated``: a bucket loaded or copied between sleep and wake (Lab 6, then ``fast_update``)
- ``timeline``: bytes by role at phase edges, and their plot (Lab 2, then ``memory``)

One code path on both kinds of machine: a tensor on a GPU goes through NCCL or CUDA IPC, one on the
CPU through gloo or a shared-memory file in ``/dev/shm``.
"""
