"""``python -m labsupport bench ipc``: a weight update through ``labsupport.ipc`` against plain
copies.

A trainer process exports a realistic bf16 state (``ipc_timing.model_state``) as buckets; an engine
process rebuilds them (first and cached rebuild times), copies them into its own inference copy, and
times that against a device-to-device copy of the same bytes (``ipc_timing.time_update_vs_copy``,
which Lab 5 also calls). Writes ``results/bench_ipc.<machine>.json`` and its plot (Chapter 5 and Lab
5 read them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from labsupport.core.devices import synchronize as _sync
from labsupport.course import hardware, progress, results
from labsupport.course.peer import Peer
from labsupport.experiments.ipc_timing import model_state, time_update_vs_copy, timed
from labsupport.experiments.sharing import memory_probe
from labsupport.ipc import Exporter, IpcError, Receiver, device_of, rebuild


def _bench_engine(inbox: Any, outbox: Any, metas: list[tuple[str, torch.dtype, tuple[int, ...]]],
                  rounds: int) -> None:
    """Engine side of the benchmark: owns a separate inference copy and updates it from IPC
    buckets."""
    handles, probes = inbox.get()
    device = device_of(handles[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # copies are memory-bound; extra threads only fight on a busy CPU
    weights = {n: torch.empty(s, dtype=d, device=device) for n, d, s in metas}
    # 1) first rebuild of fresh buckets of several sizes (opens each IPC mapping), then a cached one
    probe_ms = []
    for h in probes:
        r0 = time.perf_counter()
        views = rebuild(h)
        r1 = time.perf_counter()
        rebuild(h)
        probe_ms.append((h.nbytes, (r1 - r0) * 1e3, (time.perf_counter() - r1) * 1e3))
        del views
    _sync(device)
    outbox.put({"probe_ms": probe_ms})
    # 2) first update: map every bucket (cold) and copy into the inference copy
    receiver = Receiver()
    mem0 = memory_probe(device)
    cold_rebuild = []
    _sync(device)
    t0 = time.perf_counter()
    for h in handles:
        r0 = time.perf_counter()
        receiver.bucket(h)
        cold_rebuild.append(time.perf_counter() - r0)
        receiver.copy_into(h, weights)
    _sync(device)
    cold_update = time.perf_counter() - t0
    mem1 = memory_probe(device)
    ok = all(torch.equal(weights[n], v) for h in handles for n, v in receiver.bucket(h))
    warm_rebuild = []
    for h in handles:
        r0 = time.perf_counter()
        receiver.bucket(h)
        warm_rebuild.append(time.perf_counter() - r0)
    outbox.put({"cold_update_s": cold_update, "cold_rebuild_s": cold_rebuild,
                "warm_rebuild_s": warm_rebuild, "mem_before": mem0, "mem_after": mem1, "equal": ok})
    # 3) steady state: the trainer repacks the same buckets; the engine (mapped already) copies,
    # then does plain local copies of the same bytes for reference (same process, same run).
    ipc_s, d2d_s, flat_s = [], [], []
    for _ in range(rounds):
        if inbox.get() != "go":
            return
        got = time_update_vs_copy(handles, weights, receiver, rounds=1)
        ipc_s += got["ipc_s"]
        d2d_s += got["d2d_s"]
        flat_s += got["flat_s"]
        ok = ok and all(torch.equal(weights[n], v) for h in handles for n, v in receiver.bucket(h))
        outbox.put("done")
    receiver.drop()  # views gone, every bucket acked: now the trainer may release
    outbox.put({"ipc_s": ipc_s, "d2d_s": d2d_s, "flat_s": flat_s, "equal": ok})
    inbox.get()  # "released"
    try:
        rebuild(handles[0])
        outbox.put({"after_release": "no error (BUG)"})
    except IpcError as err:
        outbox.put({"after_release": f"IpcError: {str(err)[:80]}..."})
    inbox.get()


def main(argv: list[str] | None = None) -> int:
    """Time bucket rebuilds and an IPC weight update against a plain device-to-device copy."""
    ap = argparse.ArgumentParser(prog="python -m labsupport bench ipc", description=main.__doc__)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--gb", type=float, default=None, help="model state size (default 3 on GPU, "
                                                           "0.05 on CPU)")
    ap.add_argument("--bucket-mb", type=int, default=None, help="bucket size (default 1024 on GPU, "
                                                                "16 on CPU)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-save", action="store_true", help="print only; write no JSON/PNG")
    args = ap.parse_args(argv)
    kind = args.device
    if kind == "auto":
        kind = "cuda" if hardware.gpu_count() > 0 else "cpu"
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    gb = args.gb if args.gb is not None else (3.0 if kind == "cuda" else 0.05)
    bucket_mb = args.bucket_mb or (1024 if kind == "cuda" else 16)
    if kind == "cpu":
        torch.set_num_threads(1)
        print("CPU stand-in: shared memory between two processes, small sizes; these are not GPU "
              "numbers.")

    state = model_state(int(gb * 1e9), device)
    total = sum(t.nbytes for _, t in state)
    metas = [(n, t.dtype, tuple(t.shape)) for n, t in state]
    exporter = Exporter()
    t0 = time.perf_counter()
    handles = exporter.export_buckets(state, bucket_mb << 20)
    _sync(device)
    export_s = time.perf_counter() - t0
    mem_exp = memory_probe(device)
    probe_sizes = [s << 20 for s in ((16, 256, 1024) if kind == "cuda" else (1, 8, 32))]
    probes = [exporter.export_bucket([("x", torch.empty(n, dtype=torch.uint8, device=device))])
              for n in probe_sizes]
    with Peer(_bench_engine, metas, args.rounds) as peer:
        peer.send((handles, probes))
        probe = peer.recv(180)
        for h in probes:
            exporter.release(h, force=True)  # the peer dropped its views of them
        cold = peer.recv(180)
        pack_s = []
        tensors = dict(state)
        # each bucket's tensors, in its order
        groups = [[(n, tensors[n]) for n in h.names] for h in handles]
        for _ in progress.bar(range(args.rounds), desc="bench ipc: update rounds", unit="round"):
            pack_s.append(timed(lambda: [exporter.update_bucket(h, g) for h, g in zip(handles,
                                                                                      groups)],
                                device))
            peer.call("go", 180)
        steady = peer.recv(180)  # sent after the engine's receiver.drop(), which acked every bucket
        before_release = memory_probe(device)
        freed = sum(exporter.release(h) for h in handles)
        after_release = memory_probe(device)
        peer.send("released")
        after = peer.recv(60)
        peer.send(None)
    exporter.close()

    med = statistics.median
    gbps = lambda s: total / s / 1e9  # noqa: E731
    rows = [
        ("d2d copy, one flat buffer", med(steady["flat_s"])),
        ("d2d copy, same tensor list", med(steady["d2d_s"])),
        ("IPC update (cached handles)", med(steady["ipc_s"])),
        ("IPC update (first, opens handles)", cold["cold_update_s"]),
        ("trainer repack into buckets", med(pack_s)),
    ]
    ratio = med(steady["d2d_s"]) / med(steady["ipc_s"])
    ratio_flat = med(steady["flat_s"]) / med(steady["ipc_s"])
    rb_cold = [s * 1e3 for s in cold["cold_rebuild_s"]]
    rb_warm = [s * 1e3 for s in cold["warm_rebuild_s"]]
    grow = cold["mem_after"].get("allocated", 0) - cold["mem_before"].get("allocated", 0)
    dev_grow = cold["mem_before"].get("device_free", 0) - cold["mem_after"].get("device_free", 0)
    print(f"\nIPC weight update: {total / 1e9:.2f} GB bf16 in {len(handles)} bucket(s) of <= "
          f"{bucket_mb} MiB, {len(state)} tensors, device {device} ({kind})")
    print(f"{'what':38s} {'time ms':>10s} {'GB/s':>9s}")
    for name, s in rows:
        print(f"{name:38s} {s * 1e3:10.2f} {gbps(s):9.1f}")
    print(f"rebuild one bucket handle: first {med(rb_cold):.3f} ms median (max "
          f"{max(rb_cold):.3f}), cached {med(rb_warm):.3f} ms")
    for nbytes, first, cached in probe["probe_ms"]:
        print(f"  fresh {nbytes >> 20:5d} MiB bucket: first rebuild {first:.3f} ms, cached "
              f"{cached:.3f} ms")
    print(f"IPC update / d2d (same tensor list): {ratio:.0%}  (vs one flat copy: {ratio_flat:.0%})")
    if kind == "cuda":
        print(f"receiver allocator growth on rebuild: {grow} B; device free memory drop: "
              f"{dev_grow / 2**20:.1f} MiB (model {total / 2**20:.0f} MiB)")
        print(f"exporter memory_allocated: {before_release['allocated'] / 2**20:.0f} MiB before "
              f"release, {after_release['allocated'] / 2**20:.0f} MiB after ({freed / 2**20:.0f} "
              "MiB of buckets freed)")
    print(f"rebuild after release: {after['after_release']}")
    print(f"bytes equal after update: {cold['equal'] and steady['equal']}")
    bars = {"rebuild_le_1ms": med(rb_cold) <= 1.0, "ipc_ge_70pct_d2d": ratio >= 0.7}
    print("bars:", ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in bars.items()),
          "(bars are for GPU runs)" if kind == "cpu" else "")

    data = {
        "backend": "cuda_ipc" if kind == "cuda" else "shared_memory",
        "total_bytes": total, "n_tensors": len(state), "n_buckets": len(handles),
        "bucket_mb": bucket_mb, "dtype": "bfloat16", "rounds": args.rounds, "times_s": {name: s
                                                                                        for name,
                                                                                        s in rows},
        "gbps": {name: gbps(s) for name, s in rows}, "ipc_over_d2d": ratio,
        "ipc_over_flat_d2d": ratio_flat, "rebuild_ms_first": rb_cold, "rebuild_ms_cached": rb_warm,
        "rebuild_by_size": [{"bytes": n, "first_ms": f, "cached_ms": c} for n, f,
                            c in probe["probe_ms"]],
        "export_s": export_s, "exporter_mem_after_export": mem_exp,
        "receiver_mem_before": cold["mem_before"], "receiver_mem_after": cold["mem_after"],
        "receiver_allocated_growth": grow, "device_free_drop": dev_grow,
        "exporter_mem_before_release": before_release, "exporter_mem_after_release": after_release,
        "released_bytes": freed, "after_release": after["after_release"],
        "equal": bool(cold["equal"] and steady["equal"]), "bars": bars,
    }
    if not args.no_save:
        fig = _bench_figure(rows, rb_cold, rb_warm, total, kind)
        path = results.save_result("bench_ipc", data, figure=fig,
                                   command="python -m labsupport bench ipc " + " ".join(argv or []))
        print(f"wrote {path} (+ .png)")
    return 0


def _bench_figure(rows: list[tuple[str, float]], rb_cold: list[float], rb_warm: list[float],
                  total: int, kind: str) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    names = [n for n, _ in rows]
    a.barh(names, [total / s / 1e9 for _, s in rows], color=["#888", "#888", "#2a7", "#7c5",
                                                             "#59c"])
    a.invert_yaxis()
    a.set_xlabel("GB/s (bytes of model state / time)")
    a.set_title(f"IPC update vs d2d copy, {total / 1e9:.2f} GB "
                f"({'CUDA IPC' if kind == 'cuda' else 'shared memory'})")
    b.bar(["first", "cached"], [statistics.median(rb_cold), statistics.median(rb_warm)],
          color=["#7c5", "#2a7"])
    b.axhline(1.0, color="r", ls="--", lw=1, label="1 ms bar")
    b.set_ylabel("ms per bucket")
    b.set_title("rebuild one bucket handle")
    b.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
