"""Which devices the trainer and the engine use (:func:`pick_devices`), and why disaggregated/async
need two GPUs: :func:`nccl_on_one_gpu` shows NCCL refusing two ranks on one device."""

from __future__ import annotations

import torch


def pick_devices(arch: str, n_gpus: int | None = None) -> tuple[str, str]:
    """(trainer device, engine device): one shared device when co-located, two GPUs otherwise (if
    present)."""
    from labsupport.course import hardware

    n = hardware.gpu_count() if n_gpus is None else n_gpus
    if n == 0:
        return "cpu", "cpu"
    if arch == "colocated" or n == 1:
        return "cuda:0", "cuda:0"
    return "cuda:0", "cuda:1"


def _nccl_rank(rank: int, port: int, out) -> None:
    """One rank of :func:`nccl_on_one_gpu` (a spawned process): join the group on cuda:0,
    all-reduce, report."""
    from labsupport import groups

    try:
        g = groups.create_group("127.0.0.1", port, rank, 2, device="cuda:0", timeout_s=60.0)
        t = torch.ones(1, device="cuda:0")
        g.all_reduce(t)  # NCCL builds its communicator at the first collective
        g.destroy()
        out.put((rank, f"ok: all_reduce gave {t.item()}"))
    except Exception as exc:  # what NCCL says is the lesson
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def nccl_on_one_gpu(timeout_s: float = 120.0) -> list[str]:
    """Two processes try to form an NCCL group on the same GPU, as disaggregated/async would on one
    GPU; returns each rank's outcome. NCCL refuses two ranks on one device ("Duplicate GPU
    detected")."""
    import multiprocessing as mp
    import queue

    from labsupport import groups

    ctx, port = mp.get_context("spawn"), groups.free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for pr in procs:
        pr.start()
    got: dict[int, str] = {}
    try:
        for _ in procs:
            rank, msg = out.get(timeout=timeout_s)
            got[rank] = msg
    except queue.Empty:
        pass
    for pr in procs:  # never leave a rank behind
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    return [got.get(r, f"no answer within {timeout_s:.0f} s") for r in (0, 1)]
