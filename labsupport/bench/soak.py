"""``python -m labsupport bench soak``: many fresh runs of the co-located capstone, to find what
crashes only now and then (a learner's first run on a new machine is the one that counts).

Each run is a new process tree (``bench peer``'s capstone worker: the 0.5B policy, vLLM beside the
trainer on one GPU, the same settings as ``bench peer``), so nothing warm in one run helps the next
except the caches on disk. A cold run starts with empty compile caches of its own (vLLM's,
Inductor's, Triton's, FlashInfer's: fresh folders named in its environment), as on a new machine;
``--shared-cold`` gives the cold runs that start together one fresh folder instead, as several first
runs side by side on a new machine share the default one. Runs go side by side, one per visible GPU.
Each run records whether it finished, its exit status and the last error it printed, its median step
time and its held-out accuracy; the summary counts crashes per configuration.

Writes ``results/bench_soak.<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from labsupport.bench.peer import summarize

CACHE_VARS = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "TRITON_CACHE_DIR": "triton", "FLASHINFER_WORKSPACE_BASE": "flashinfer",
              "XDG_CACHE_HOME": "xdg"}
SKIP = 3  # warm-up steps left out of a run's median step (bench peer's default)
ERROR = re.compile(r"(Error|Exception|error:|Aborted|Killed|core dumped)")


def jobs(configs: list[str], runs: int, cold: int, seeds: list[int]) -> list[dict[str, Any]]:
    """``runs`` runs of each configuration, the first ``cold`` of each cold, seeds in turn;
    interleaved so that configurations run side by side (round r holds run r of every
    configuration)."""
    out = []
    for i in range(runs):
        for c in configs:
            out.append({"config": c, "seed": seeds[i % len(seeds)], "cold": i < cold, "index": i})
    return out


def cache_env(root: str) -> dict[str, str]:
    """Fresh compile-cache folders under ``root`` for every cache a run fills."""
    env = {var: os.path.join(root, sub) for var, sub in CACHE_VARS.items()}
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    return env


def last_error(text: str) -> str:
    """The last line of a run's output that names an error (or its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if ERROR.search(ln)]
    return (hits or lines or [""])[-1][:400]


def run_one(job: dict[str, Any], peer_args: list[str], gpu: str | None, timeout: float,
            env_extra: dict[str, str], log_dir: Path) -> dict[str, Any]:
    """One run in a child process; its outcome (never raises: a crash is a result)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "labsupport", "bench", "peer", *peer_args, "--worker",
               "capstone", "--config", job["config"], "--capstone-configs", job["config"], "--seed",
               str(job["seed"]), "--out", f.name]
        env = {**os.environ, "LABSUPPORT_PROGRESS": "0", **env_extra,
               **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
        log = log_dir / f"soak-{job['config'].replace('+', '_')}-{job['index']}-s{job['seed']}.log"
        t0 = time.perf_counter()
        try:
            with open(log, "w") as out:
                rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        rec = {**job, "gpu": gpu, "returncode": rc, "wall_s": wall, "log": log.name}
        done = rc == 0 and Path(f.name).stat().st_size
        data = json.loads(Path(f.name).read_text()) if done else None
    if data is None:
        return {**rec, "ok": False, "error": last_error(text) if rc != "timeout"
                else f"no result in {timeout:.0f} s"}
    steps = summarize(data, SKIP)  # bench peer's medians, over the same steps
    return {**rec, "ok": bool(data["weights_match"]), "error": None if data["weights_match"] else
            "the engine's weights differ from the trainer's after the run",
            "ms_per_step": steps["ms_per_step"], "final_acc": steps["final_acc"],
            "engine_final_acc": data["engine_final_acc"],
            "weights_match": data["weights_match"]}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: runs, cold runs, crashes (cold ones too), the errors seen, the median step
    time."""
    out: dict[str, dict[str, Any]] = {}
    for c in dict.fromkeys(r["config"] for r in runs):
        rs = [r for r in runs if r["config"] == c]
        ok = [r for r in rs if r["ok"]]
        out[c] = {"runs": len(rs), "cold": sum(r["cold"] for r in rs), "failed": len(rs) - len(ok),
                  "failed_cold": sum(r["cold"] and not r["ok"] for r in rs),
                  "errors": sorted({r["error"] for r in rs if r["error"]}),
                  "ms_per_step": statistics.median(r["ms_per_step"] for r in ok) if ok else None}
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labsupport bench soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="fastest", help="capstone configurations "
                                                        "(rl.colocated.CONFIGS), comma-separated")
    p.add_argument("--runs", type=int, default=24, help="runs of each configuration")
    p.add_argument("--cold", type=int, default=8, help="of which the first this many start with "
                                                       "empty caches")
    p.add_argument("--shared-cold", action="store_true",
                   help="cold runs that start together share one fresh cache folder (as on a new "
                        "machine)")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gpus", type=int, default=None, help="runs side by side (default: every "
                                                          "visible GPU)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one run")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every run")
    p.add_argument("--peer-args", default="", help="more arguments for bench peer's worker (its "
                                                   "settings)")
    p.add_argument("--tag", default=None, help="a name for this soak in the results file "
                                               "(bench_soak-TAG)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: merge soaks that ran side by side (one per lane of GPUs) into one "
                        "record")
    p.add_argument("--machine-tag", default=None, help="with --merge: the whole machine's tag "
                                                       "(e.g. 4xH200)")
    return p


def _lanes(rec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A soak's lane and runs, or a merged record's (a soak on more lanes adds to it)."""
    d = rec["data"]
    if "lanes" in d:
        return d["lanes"], d["runs"]
    lane = {"command": rec["command"], "settings": d["settings"], "env": d["env"],
            **({"unfinished": d["unfinished"]} if d.get("unfinished") else {})}
    return [lane], [{**r, "lane": d["settings"].get("tag")} for r in d["runs"]]


def merge(paths: list[str], tag: str | None) -> int:
    """One record of several soaks on one machine (lanes side by side, or one after another; a
    record merged before takes more lanes): every run with its lane's command, the summary over
    all of them; written as ``results/bench_soak.<tag>.json``."""
    from labsupport.course import results

    recs = [json.loads(Path(p).read_text()) for p in paths]
    lanes: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for rec in recs:
        rec_lanes, rec_runs = _lanes(rec)
        seen = {r.get("lane") for r in runs}
        if "lanes" not in rec["data"] and rec_runs and (was := rec_runs[0]["lane"]) in seen:
            # a later soak that reused a tag: its runs get a lane name of their own (tag-2, ...)
            name = next(f"{was}-{i}" for i in range(2, len(seen) + 3) if f"{was}-{i}" not in seen)
            rec_runs = [{**r, "lane": name} for r in rec_runs]
            rec_lanes = [{**rec_lanes[0], "lane": name}]
        lanes += rec_lanes
        runs += rec_runs
    first = recs[0]
    # a GPU that two lanes used one after the other is one GPU: count the devices the runs named
    gpus = [first["machine"]["gpus"][0]] * len({r.get("gpu") for r in runs})
    record = {**first, "name": "bench_soak", "machine": {**first["machine"], "gpus": gpus,
                                                         "gpu_count": len(gpus)},
              "machine_tag": tag or first["machine_tag"],
              "command": "; ".join(lane["command"] for lane in lanes),
              "date": max(rec["date"] for rec in recs),
              "data": {"lanes": lanes, "runs": runs, "summary": summary(runs)}}
    out = Path(os.environ.get("LABSUPPORT_RESULTS_DIR",
                              results.RESULTS_DIR)) / f"bench_soak.{record['machine_tag']}.json"
    print("wrote", results.write_record(out, record))
    return 0


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.merge:
        return merge(a.merge, a.machine_tag)
    from labsupport.course import hardware, results
    from labsupport.rl.colocated import config_overrides

    configs = a.configs.split(",")
    for c in configs:
        config_overrides(c)  # an unknown name fails now
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(max(hardware.gpu_count(), 1))]
    n = min(a.gpus or len(ids), len(ids))
    free: queue.Queue[str] = queue.Queue()
    for i in ids[:n]:
        free.put(i)
    env = dict(kv.split("=", 1) for kv in a.env)
    peer_args = ["--steps", str(a.steps), *a.peer_args.split()]
    log_dir = Path(os.environ.get("LABSUPPORT_RESULTS_DIR", "results")) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="soak-caches-")
    todo = jobs(configs, a.runs, a.cold, [int(s) for s in a.seeds.split(",")])

    def one(job: dict[str, Any]) -> dict[str, Any]:
        gpu = free.get()
        try:
            where = (f"round{job['index']}" if a.shared_cold
                     else f"{job['config']}-{job['index']}-{gpu}")
            extra = {**env, **(cache_env(os.path.join(root, where)) if job["cold"] else {})}
            r = run_one(job, peer_args, gpu if hardware.gpu_count() else None, a.timeout, extra,
                        log_dir)
        finally:
            free.put(gpu)
        print(json.dumps({k: r.get(k) for k in ("config", "seed", "cold", "gpu", "ok",
                                                "ms_per_step", "error")}),
              flush=True)
        return r

    name = f"bench_soak-{a.tag}" if a.tag else "bench_soak"
    settings = {**vars(a), "side_by_side": n}
    done: list[dict[str, Any]] = []
    with ThreadPoolExecutor(n) as pool:  # the record is rewritten as each run ends (a soak cut
        for r in pool.map(one, todo):  # short by its machine keeps the runs that finished)
            done.append(r)
            if left := len(todo) - len(done):  # (the whole record is written below)
                results.save_result(name, {"settings": settings, "env": env, "runs": done,
                                           "summary": summary(done), "unfinished": left})
    runs = done
    summ = summary(runs)
    print(f"{'configuration':28s} {'runs':>5s} {'cold':>5s} {'failed':>7s} {'cold failed':>12s} "
          f"{'ms/step':>8s}")
    for c, s in summ.items():
        ms = f"{s['ms_per_step']:8.0f}" if s["ms_per_step"] is not None else f"{'-':>8s}"
        print(f"{c:28s} {s['runs']:5d} {s['cold']:5d} {s['failed']:7d} {s['failed_cold']:12d} {ms}")
        for e in s["errors"]:
            print(f"  {e}")
    print("wrote", results.save_result(name, {"settings": settings, "env": env, "runs": runs,
                                              "summary": summ}))
    return 0 if all(r["ok"] for r in runs) else 1
