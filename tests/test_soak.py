"""The soak benchmark (``bench soak``) and the fault it was built to find: the trainer's CUDA-graph trees in the
same process as vLLM's captured CUDA graphs (``rl.colocated.trainer_graphs``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labsupport.bench import soak
from labsupport.rl.colocated import config_overrides, trainer_graphs
from labsupport.rl.config import RLConfig

REPO = Path(__file__).resolve().parents[1]


def test_jobs_interleave_configurations_and_count_cold_runs():
    jobs = soak.jobs(["a", "b"], runs=3, cold=1, seeds=[0, 1])
    assert [(j["config"], j["index"], j["seed"], j["cold"]) for j in jobs] == [
        ("a", 0, 0, True), ("b", 0, 0, True), ("a", 1, 1, False), ("b", 1, 1, False),
        ("a", 2, 0, False), ("b", 2, 0, False)]


def test_a_cold_run_gets_fresh_folders_for_every_compile_cache(tmp_path):
    env = soak.cache_env(str(tmp_path))
    assert set(env) == set(soak.CACHE_VARS)
    assert len(set(env.values())) == len(env) and all(Path(p).is_dir() for p in env.values())


def test_the_last_error_line_is_what_a_crash_reports():
    text = "step 1\nRuntimeError: CUDA error: an illegal memory access was encountered\nframe #0: ...\n"
    assert "illegal memory access" in soak.last_error(text)
    assert soak.last_error("all fine\n") == "all fine"


def test_summary_counts_failures_and_cold_failures():
    runs = [{"config": "x", "cold": True, "ok": False, "error": "boom"},
            {"config": "x", "cold": False, "ok": True, "error": None, "ms_per_step": 10.0},
            {"config": "x", "cold": False, "ok": True, "error": None, "ms_per_step": 30.0}]
    s = soak.summary(runs)["x"]
    assert (s["runs"], s["cold"], s["failed"], s["failed_cold"], s["errors"], s["ms_per_step"]) == (
        3, 1, 1, 1, ["boom"], 20.0)


@pytest.mark.parametrize("gpus, tag", [(("0", "1"), "2xG"), (("0", "0"), "1xG")])
def test_merge_makes_one_record_of_lanes_side_by_side_or_one_after_another(tmp_path, monkeypatch, gpus, tag):
    def lane(name, ok, gpu):
        return {"name": "bench_soak", "machine": {"gpus": [{"name": "G"}], "gpu_count": 1}, "machine_tag": "1xG",
                "versions": {}, "command": f"soak --tag {name}", "date": f"2026-01-0{1 + ok}",
                "data": {"settings": {"tag": name}, "env": {}, "runs": [{"config": "c", "cold": False, "ok": ok,
                         "error": None if ok else "x", "ms_per_step": 1.0, "gpu": gpu}]}}
    paths = []
    for name, ok, gpu in zip("ab", (True, False), gpus):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(lane(name, ok, gpu)))
    monkeypatch.setenv("LABSUPPORT_RESULTS_DIR", str(tmp_path))
    assert soak.merge([str(p) for p in paths], tag) == 0
    rec = json.loads((tmp_path / f"bench_soak.{tag}.json").read_text())
    # lanes on GPUs of their own add GPUs; lanes one after another on the same GPU do not
    assert rec["machine"]["gpu_count"] == len(set(gpus)) and rec["machine_tag"] == tag
    assert rec["name"] == "bench_soak" and [r["lane"] for r in rec["data"]["runs"]] == ["a", "b"]
    assert rec["data"]["summary"]["c"]["failed"] == 1
    # a merged record takes more lanes (another session's soak on the same kind of machine)
    more = tmp_path / "c.json"
    more.write_text(json.dumps(lane("c", True, "0")))
    assert soak.merge([str(tmp_path / f"bench_soak.{tag}.json"), str(more)], tag) == 0
    rec = json.loads((tmp_path / f"bench_soak.{tag}.json").read_text())
    assert [r["lane"] for r in rec["data"]["runs"]] == ["a", "b", "c"] and len(rec["data"]["lanes"]) == 3
    assert rec["data"]["summary"]["c"]["runs"] == 3 and rec["machine"]["gpu_count"] == len(set(gpus))
    # a later soak that reused a tag keeps its runs apart (lane a-2), and says what it left unfinished
    again = lane("a", True, "0")
    again["data"]["unfinished"] = 5
    more.write_text(json.dumps(again))
    assert soak.merge([str(tmp_path / f"bench_soak.{tag}.json"), str(more)], tag) == 0
    rec = json.loads((tmp_path / f"bench_soak.{tag}.json").read_text())
    assert [r["lane"] for r in rec["data"]["runs"]] == ["a", "b", "c", "a-2"]
    assert rec["data"]["lanes"][-1]["unfinished"] == 5 and "unfinished" not in rec["data"]["lanes"][0]
    assert rec["data"]["lanes"][-1]["lane"] == "a-2"


def test_a_soak_cut_short_keeps_the_runs_that_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSUPPORT_RESULTS_DIR", str(tmp_path))
    calls = []

    def run_one(job, *args):  # the second run never ends: its machine is taken away
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {**job, "ok": True, "error": None, "ms_per_step": 5.0}
    monkeypatch.setattr(soak, "run_one", run_one)
    with pytest.raises(KeyboardInterrupt):
        soak.main(["--configs", "fast", "--runs", "3", "--cold", "0", "--tag", "t"])
    rec = json.loads(next(tmp_path.glob("bench_soak-t.*.json")).read_text())["data"]
    assert len(rec["runs"]) == 1 and rec["unfinished"] == 2 and rec["summary"]["fast"]["runs"] == 1


@pytest.mark.parametrize("name, graphs", [("fastest", True), ("fast", True), ("fastest+inline", False),
                                          ("fastest+inline+no-graphs", True), ("safe", True)])
def test_the_trainer_records_no_cuda_graphs_beside_an_inline_engine_that_has_its_own(name, graphs):
    """Torch's CUDA-graph trees free the process's cuBLAS workspaces around each recording; an inline vLLM's
    captured graphs still use them (the illegal memory access of results/logs/repro_cublas_workspace_*)."""
    cfg = RLConfig(**config_overrides(name))
    assert trainer_graphs("colocated", "vllm", cfg) is graphs
    assert trainer_graphs("colocated", "transformers", cfg) is True
    assert trainer_graphs("disaggregated", "vllm", cfg) is True


def test_the_fastest_configuration_keeps_the_engine_core_out_of_the_trainers_process():
    cfg = RLConfig(**config_overrides("fastest"))
    assert cfg.compile and not cfg.inline_engine and cfg.cuda_graphs


@pytest.mark.gpu(1)
def test_freeing_cublas_workspaces_under_a_captured_graph_faults_on_replay():
    """The hazard itself, in torch alone (each case in a child process: a CUDA fault ends its process): a graph
    whose matrix product used a workspace allocated inside the capture replays into freed memory once the
    workspaces are cleared and the cache emptied, as cudagraph trees and ``torch.cuda.graph`` do."""
    script = str(REPO / "tools" / "repro_cublas_workspace.py")
    safe = subprocess.run([sys.executable, script, "torch-case", "64", "1", "0"], capture_output=True, timeout=300)
    assert safe.returncode == 0, safe.stderr[-2000:]
    hit = subprocess.run([sys.executable, script, "torch-case", "64", "0", "1"], capture_output=True, timeout=300)
    assert hit.returncode != 0, "replay after clearing the workspace no longer faults: re-check trainer_graphs"


def test_a_timed_update_keeps_seconds_as_parts_and_the_rest_as_stats(monkeypatch):
    """``bench vllm-update``'s disaggregated modes return ``push_weights``' stats (a mode name, counts, the
    workers' replies): only seconds are parts (the first 4-GPU run failed adding a name to the parts' sum)."""
    import torch

    from labsupport.bench import vllm_update

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(vllm_update, "engine_tokens", lambda llm: [[1]])
    row = vllm_update.timed(lambda: {"mode": "bucketed", "n_tensors": 3, "seconds": 0.5, "load_s": 0.1}, None)
    assert row["parts"] == {"load_s": 0.1}
    assert row["stats"] == {"mode": "bucketed", "n_tensors": 3, "seconds": 0.5}
    assert vllm_update.timed(lambda: None, None)["parts"] == {}
