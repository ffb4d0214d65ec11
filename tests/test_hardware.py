"""labsupport.hardware and labsupport.results: the doctor agrees with torch, labs pick their path."""

import json
import subprocess
import sys

import pytest
import torch

from labsupport import hardware, results
from labsupport.bench import links


def test_doctor_counts_match_torch(monkeypatch):
    monkeypatch.delenv(hardware.FORCE_CPU_ENV, raising=False)
    rep = hardware.doctor(check_ipc=False)
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rep["gpu_count"] == expected == len(rep["gpus"])
    assert rep["backend"] == ("nccl" if expected else "gloo")
    assert len(rep["p2p"]) == expected
    # every lab appears with its front-matter requirement, and the path follows from it
    reqs = hardware.lab_requirements()
    assert set(rep["labs"]) == set(reqs) and "lab_01_environment" in reqs
    for lab, info in rep["labs"].items():
        assert info["path"] == ("GPU" if reqs[lab] and expected >= reqs[lab] else "CPU")


def test_force_cpu_env(monkeypatch):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")
    assert hardware.gpu_count() == 0
    assert hardware.backend() == "gloo"
    env = hardware.lab_setup(min_gpus=1, title="t")
    assert (env.gpu, env.device, env.backend, env.path) == (False, "cpu", "gloo", "CPU")


def test_lab_setup_banner_says_why(monkeypatch, capsys):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")
    hardware.lab_setup(min_gpus=3, title="Lab X")
    out = capsys.readouterr().out
    assert "Lab X" in out and "CPU path" in out and "needs 3 GPU(s), found 0" in out


def test_require_gpus_message(monkeypatch):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")
    with pytest.raises(RuntimeError, match=r"needs 2 CUDA GPU\(s\); this machine shows 0"):
        hardware.require_gpus(2, "the broadcast")
    hardware.require_gpus(0)  # zero GPUs always available


def test_doctor_cli_json():
    out = subprocess.run([sys.executable, "-m", "labsupport", "doctor", "--json", "--no-ipc"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rep = json.loads(out)
    assert rep["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert rep["versions"]["torch"] == torch.__version__


def test_measure_links_cpu_positive(monkeypatch):
    monkeypatch.setenv(hardware.FORCE_CPU_ENV, "cpu")
    rows = links.measure_links(size_mib=8, iters=2)
    assert [r["link"] for r in rows] == ["host memcpy (CPU)"]
    assert rows[0]["gb_per_s"] == pytest.approx(rows[0]["bytes"] / rows[0]["seconds"] / 1e9)


def test_format_table_aligns():
    text = links.format_table([{"a": 1, "b": 2.5}, {"a": "long", "b": 0.001}], ["a", "b"])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b"] and len(lines) == 4
    assert len({len(ln.rstrip()) for ln in lines[2:]}) >= 1 and "0.001" in lines[3]


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
    assert results.machine_tag({"gpus": [{"name": "NVIDIA H200"}] * 4, "gpu_count": 4}) == "4xH200"
    assert results.machine_tag({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}], "gpu_count": 1}) == "1xH100"


@pytest.mark.gpu(1)
def test_cuda_ipc_works_on_gpu():
    assert hardware.cuda_ipc_works() is True
    uuid = hardware.gpu_uuid(0)
    assert uuid.startswith("GPU-") and len(uuid) > 10


@pytest.mark.gpu(1)
def test_measure_links_gpu_rows():
    rows = {r["link"]: r for r in links.measure_links(size_mib=64, iters=2)}
    assert rows["device copy (GPU0)"]["gb_per_s"] > rows["host->device pageable"]["gb_per_s"]
    assert rows["host->device pinned"]["gb_per_s"] > 1


def test_lab_front_matter_matches_lab_setup():
    """The min_gpus that conftest/doctor read must be the one each lab's first cell passes to lab_setup."""
    import re

    for lab, need in hardware.lab_requirements().items():
        text = (hardware.LABS_DIR / f"{lab}.md").read_text()
        calls = re.findall(r"lab_setup\(min_gpus=(\d+)", text)
        assert calls == [str(need)], f"{lab}: front matter says min_gpus={need}, lab_setup calls {calls}"


def test_doctor_command_prints_the_report_as_json(capsys):
    """``python -m labsupport doctor --json`` prints what ``hardware.doctor()`` finds."""
    import json

    from labsupport.__main__ import main

    assert main(["doctor", "--json", "--no-ipc"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["gpu_count"] == hardware.gpu_count() and rep["backend"] == hardware.backend()
    assert main(["no-such-command"]) == 2
