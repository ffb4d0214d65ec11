"""The short path: each mechanism in straight lines (about 500 lines, nothing outside ``core/``
but torch), in this order; each lab runs its core first, then the hardened module:

- ``devices``: a GPU's identity (its UUID), a wait for its queue, a CUDA IPC handle's device slot
- ``buckets``: named tensors laid out in one flat byte buffer, and the buffer sliced back into them
- ``sync``: NCCL weight sync: metadata, one broadcast per bucket, load (Lab 3, then ``broadcast``)
- ``handoff``: CUDA IPC: export, rebuild with device remap, load, release (Lab 5, then ``ipc``)
- ``colocated``: a bucket loaded or copied between sleep and wake (Lab 6, then ``fast_update``)
- ``timeline``: bytes by role at phase edges, and their plot (Lab 2, then ``memory``)

One code path: GPU tensors go through NCCL or CUDA IPC, CPU ones through gloo or ``/dev/shm``.
"""
