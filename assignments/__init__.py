"""Your assignments: one file each, in the order the chapters teach them. Replace each ``raise NotImplementedError``.

- ``a1_timeline``: a memory timeline of one RLHF step by role, and its plot (Chapter 2, Lab 2)
- ``a2_buckets``: named tensors into one flat, aligned buffer and back (Chapter 4, Lab 3)
- ``a3_sync``: a weight sync over a stateless group: metadata, one broadcast per bucket, load (Chapter 4, Lab 3)
- ``a4_handoff``: a CUDA IPC handoff: export, rebuild in another process by GPU UUID, load, release (Chapter 5, Lab 5)
- ``a5_colocated``: the co-located cycle on a real vLLM engine: sleep, train, wake, update, reset (Chapter 5, Lab 6)
- ``a6_grpo``: the GRPO loss with group advantages, and its TIS/MIS correction (Chapter 9, Lab 9)

and ``diagnosis.toml``: your seed and your answers to the three diagnosis labs (``labs/lab_d*_*.md``).

Each file states its contract in its docstrings; its public tests are ``grading/test_<file>.py``. ``make grade``
runs them on your files and prints the points; ``make grade IMPL=reference`` grades the course's own code.
``LABSUPPORT_IMPL=assignments make lab`` runs Labs 2 and 3 on your ``a1_timeline`` and ``a3_sync``.
"""
