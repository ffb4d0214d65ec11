"""The course's apparatus: what makes the labs run, not a mechanism a chapter teaches.

- ``results``: reference results under results/, each with its machine, versions, command and date
- ``hardware``: what this machine has, and the one place that picks the GPU path or the CPU stand-in
- ``progress``: progress on long work, the same in a terminal and in a notebook
- ``models``: the tiny language model and tokenizer, built and trained offline
- ``versions``: every difference between the vLLM and torch versions the course runs
- ``ranks``: run a function on N ranks in fresh processes with a deadline (tests and benchmarks)
- ``peer``: a helper process that rebuilds handles, for the labs' two-process experiments
- ``planner``: memory and transfer-time arithmetic for designs at scale
- ``sync_timing``, ``ipc_timing``: a sync or an IPC update timed here and now, as Labs 3 and 5 do
"""
