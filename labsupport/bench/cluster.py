"""``python -m labsupport bench cluster``: GPU placement, fractional sharing, NCCL and IPC between
Ray actors."""

from __future__ import annotations

import argparse
import time
from typing import Any

from labsupport.course import hardware
from labsupport.experiments.cluster import RayWorker, actor_resources, init_ray, place



def _bench_broadcast(w: RayWorker, addr: str, port: int, rank: int, nbytes: int, device: str,
                     iters: int) -> dict[str, Any]:
    """One rank of a timed broadcast (rank 0 sends ``nbytes``); returns seconds per broadcast and a
    checksum."""
    import torch

    from labsupport.groups import create_group

    g = create_group(addr, port, rank, 2, device=device, timeout_s=120)
    n = nbytes // 4
    # int32, not float32: float32 cannot hold every integer above 2**24, so arange's last value
    # would round
    t = (torch.arange(n, dtype=torch.int32, device=device) if rank == 0
         else torch.zeros(n, dtype=torch.int32, device=device))
    g.broadcast(t, src=0)  # warm-up
    g.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.broadcast(t, src=0)
    g.synchronize()
    dt = (time.perf_counter() - t0) / iters
    ok = bool(t[-1].item() == n - 1 and t[n // 2].item() == n // 2)
    g.destroy()
    return {"seconds": dt, "ok": ok}


def _bench_export(w: RayWorker, nbytes: int, device: str) -> Any:
    import torch

    from labsupport import ipc

    w.owned = torch.zeros(nbytes // 4, device=device)
    w.exporter = ipc.Exporter()
    return w.exporter.export_tensor(w.owned)


def _bench_rebuild_and_write(w: RayWorker, handle: Any) -> dict[str, Any]:
    from labsupport import ipc

    t0 = time.perf_counter()
    (_, t), = ipc.rebuild(handle)
    rebuild_s = time.perf_counter() - t0
    t.fill_(7.0)
    device = str(t.device)
    del t
    # the write is done (ack waits for the GPU) and the view gone: the owner may release
    ipc.ack(handle)
    return {"rebuild_s": rebuild_s, "device": device}


def _bench_owner_sees(w: RayWorker, handle: Any) -> bool:
    ok = bool((w.owned == 7.0).all())
    w.exporter.release(handle)
    return ok


def main(argv: list[str]) -> int:
    """``python -m labsupport bench cluster``: GPU placement, fractional sharing, NCCL and IPC
    between Ray actors."""
    import ray

    from labsupport.course import results

    p = argparse.ArgumentParser(prog="python -m labsupport bench cluster", description=main.__doc__)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all, at least 2)")
    p.add_argument("--share", type=float, default=0.4, help="fractional num_gpus per co-located "
                                                            "actor")
    p.add_argument("--mib", type=int, default=None, help="tensor size for broadcast/IPC (default "
                                                         "1024 GPU, 64 CPU)")
    a = p.parse_args(argv)
    summary = init_ray()
    gpu = hardware.gpu_count() > 0
    n = a.gpus or max(2, int(summary["GPU"]) or 2)
    nbytes = (a.mib or (1024 if gpu else 64)) << 20
    device = "cuda:0" if gpu else "cpu"  # inside each actor
    worker = ray.remote(RayWorker)
    pl = place({"trainer": 1, "engine": n - 1}, gpu=gpu)
    share = actor_resources(gpu, a.share)
    rows = []
    # 1. co-location: two actors with fractional shares on every bundle must report the same
    #    physical GPU
    for role in pl.roles:
        for i in range(len(pl.roles[role])):
            pair = [worker.options(**share, scheduling_strategy=pl.scheduling(role, i)).remote()
                    for _ in range(2)]
            infos = ray.get([w.info.remote() for w in pair], timeout=300)
            rows.append({"role": role, "bundle": pl.roles[role][i], "node": infos[0]["node_id"][:8],
                         "uuids": [x["gpu_uuids"] for x in infos],
                         "same_gpu": infos[0]["gpu_uuids"] == infos[1]["gpu_uuids"]})
            for w in pair:
                ray.kill(w)
    # 2. a broadcast from the trainer's bundle to the first engine bundle (NCCL on GPU, gloo on CPU)
    a0, a1 = (worker.options(**share, scheduling_strategy=pl.scheduling(r)).remote()
              for r in ("trainer", "engine"))
    addr, port = ray.get(a0.rendezvous.remote(), timeout=300)
    bc = ray.get([a0.run.remote(_bench_broadcast, addr, port, 0, nbytes, device, 5),
                  a1.run.remote(_bench_broadcast, addr, port, 1, nbytes, device, 5)], timeout=300)
    bcast = {"bytes": nbytes, "seconds": bc[0]["seconds"], "gb_per_s": nbytes / bc[0]["seconds"]
             / 1e9, "backend": "nccl" if gpu else "gloo", "receiver_ok": bc[1]["ok"]}
    for w in (a0, a1):
        ray.kill(w)  # free their shares: the IPC pair below takes two more on the trainer's bundle
    # 3. IPC between two fractional actors on the same bundle: the peer's write is seen by the owner
    owner, peer = (worker.options(**share, scheduling_strategy=pl.scheduling("trainer")).remote()
                   for _ in range(2))
    handle = ray.get(owner.run.remote(_bench_export, nbytes, device), timeout=300)
    got = ray.get(peer.run.remote(_bench_rebuild_and_write, handle), timeout=300)
    ipc_row = {"bytes": nbytes, "rebuild_ms": got["rebuild_s"] * 1e3, "peer_device": got["device"],
               "owner_sees_write": ray.get(owner.run.remote(_bench_owner_sees, handle))}
    for w in (owner, peer):
        ray.kill(w)
    print(f"{'role':<8}{'bundle':>7}  same GPU for two {a.share}-share actors")
    for r in rows:
        print(f"{r['role']:<8}{r['bundle']:>7}  {r['same_gpu']}  {r['uuids'][0]}")
    print(f"broadcast between Ray actors ({bcast['backend']}): {nbytes >> 20} MiB in "
          f"{bcast['seconds'] * 1e3:.1f} ms = {bcast['gb_per_s']:.1f} GB/s, receiver bytes ok: "
          f"{bcast['receiver_ok']}")
    print(f"IPC between two actors on one {'GPU' if gpu else 'CPU bundle'}: rebuild "
          f"{ipc_row['rebuild_ms']:.2f} ms, owner sees the peer's write: "
          f"{ipc_row['owner_sees_write']}")
    out = results.save_result("cluster_placement", {"placement": pl.describe(), "rows": rows,
                                                    "share": a.share, "broadcast": bcast,
                                                    "ipc": ipc_row},
                              command="python -m labsupport bench cluster " + " ".join(argv))
    print(f"wrote {out}")
    pl.remove()
    ray.shutdown()
    ok = all(r["same_gpu"] for r in rows) and bcast["receiver_ok"] and ipc_row["owner_sees_write"]
    return 0 if ok else 1
