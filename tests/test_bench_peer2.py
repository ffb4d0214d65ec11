"""bench peer2 without GPUs: its arguments, job list and lanes, the summary and ratio math on synthetic runs, the
unequal-settings record, the server's deadlines, the tree-attention fallback, and the capstone's jobs on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from labsupport.bench import peer2


def args(*extra: str):
    return peer2.parser().parse_args(list(extra))


def test_jobs_put_each_pair_side_by_side_per_seed_and_refuse_unknown_names():
    a = args("--seeds", "0,1")
    got = peer2.jobs(a)
    assert got[:5] == [("trl:server", 0), ("capstone:disaggregated", 0), ("trl:async", 0), ("capstone:async", 0),
                       ("capstone:colocated", 0)]
    assert len(got) == 10 and got[5] == ("trl:server", 1)
    assert peer2.jobs(args("--jobs", "capstone:async,trl:async", "--seeds", "3")) == [("trl:async", 3),
                                                                                      ("capstone:async", 3)]
    with pytest.raises(ValueError, match="unknown job"):
        peer2.jobs(args("--jobs", "trl:colocate"))


def test_lanes_split_the_gpus_and_each_child_sees_its_own():
    assert peer2.lanes(args("--gpus", "4"), None) == [["0", "1"], ["2", "3"]]
    assert peer2.lanes(args("--gpus", "2"), "4,5,6") == [["4", "5"]]
    with pytest.raises(ValueError, match="visible"):
        peer2.lanes(args("--gpus", "4"), "0,1")
    assert peer2.child_env("trl:server", ["2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2"}  # the server gets "3"
    assert peer2.child_env("capstone:async", ["2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert peer2.child_env("capstone:colocated", ["2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2"}


def synthetic(job, seed, ms, accs, overlap=None, hist=None):
    steps = [{"step": k + 1, "wall_s": ms / 1e3, "generate": 0.1, "train": 0.2} for k in range(10)]
    curve = [{"step": s, "eval_acc": acc} for s, acc in accs]
    return {"job": job, "seed": seed, "steps": steps, "curve": curve, "overlap": overlap,
            "staleness_histogram": hist}


def test_summary_ratios_and_architectures_hand_computed():
    runs = [synthetic("trl:server", 0, 400, [(0, 0.0), (10, 0.9)]),
            synthetic("capstone:disaggregated", 0, 100, [(0, 0.0), (5, 0.85), (10, 0.9)]),
            synthetic("trl:server", 1, 500, [(0, 0.0), (10, 0.9)]),
            synthetic("capstone:disaggregated", 1, 200, [(0, 0.0), (5, 0.5), (10, 0.9)]),
            synthetic("capstone:async", 0, 80, [(0, 0.0), (10, 0.7)], overlap=[2.0, 1.5, 1.1, 1.0, 1.2],
                      hist={"0": 512, "1": 4608}),
            synthetic("capstone:colocated", 0, 300, [(0, 0.0), (5, 0.8)])]
    for r in runs:
        r["summary"] = peer2.summarize(r, 3, 512, peer2.GPUS.get(r["job"], 2), 0.8)
    cap0 = runs[1]["summary"]
    assert cap0["ms_per_step"] == pytest.approx(100)
    assert cap0["samples_per_s_per_gpu"] == pytest.approx(512 / 0.1 / 2)
    assert cap0["time_to_target_s"] == pytest.approx(0.5)  # 5 steps of 0.1 s to the first 0.85 >= 0.8
    assert runs[3]["summary"]["time_to_target_s"] == pytest.approx(2.0)  # reached only at step 10
    assert runs[4]["summary"]["time_to_target_s"] is None  # never reached
    assert runs[4]["summary"]["overlap_median"] == pytest.approx(1.1)  # of [1.0, 1.2] after 3 warm-up steps
    assert runs[4]["summary"]["mean_staleness"] == pytest.approx(0.9)
    assert runs[5]["summary"]["samples_per_s_per_gpu"] == pytest.approx(512 / 0.3)  # one GPU
    got = peer2.compare(runs + [{"job": "trl:async", "seed": 0, "error": "RuntimeError: no server"}])
    assert got["pairs"]["disaggregated"]["per_seed"] == {"0": pytest.approx(0.25), "1": pytest.approx(0.4)}
    assert got["pairs"]["disaggregated"]["mean"] == pytest.approx(0.325)
    assert got["pairs"]["async"] == {"per_seed": {}, "mean": None}  # TRL's async run failed: no ratio
    d = got["architectures"]["disaggregated"]
    assert d["gpus"] == 2 and d["seeds"] == 2 and d["ms_per_step"] == pytest.approx(150)
    assert d["time_to_target_s"] == pytest.approx(1.25)
    assert got["architectures"]["async"]["time_to_target_s"] is None
    assert got["architectures"]["colocated"]["gpus"] == 1


def test_a_run_cut_short_keeps_the_jobs_that_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSUPPORT_RESULTS_DIR", str(tmp_path))
    calls = []

    def run_child(argv, a, job, seed, lane):  # the second job never ends: its machine is taken
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return synthetic(job, seed, 100, [(0, 0.0), (10, 0.9)])
    monkeypatch.setattr(peer2, "run_child", run_child)
    with pytest.raises(KeyboardInterrupt):
        peer2.main(["--device", "cpu", "--jobs", "capstone:disaggregated,capstone:async",
                    "--seeds", "0", "--gpus", "2", "--out-name", "p2cut"])
    [path] = tmp_path.glob("p2cut.*.json")
    rec = json.loads(path.read_text())
    assert [r["job"] for r in rec["data"]["runs"]] == ["capstone:disaggregated"]
    assert rec["data"]["unfinished"] == 1 and "disaggregated" in rec["data"]["architectures"]
    merged = peer2.merged([rec])
    assert merged["data"]["unfinished"] == 1


def test_the_record_names_every_unequal_setting_and_what_the_runs_used():
    a = args()
    runs = [{"job": "trl:async", "seed": 0, "attention": "torch SDPA with a per-segment mask (x)"}]
    rec = peer2.record(a, runs)
    for key in ("weight transfer", "KL term (async)", "staleness (async)", "micro-batches (async)",
                "attention (async)", "capstone configuration"):
        assert key in rec["unequal"], key
    assert "torch SDPA" in rec["unequal"]["attention (async)"]
    assert rec["settings"]["trl_max_staleness"] == 1 and rec["settings"]["steps"] == 30
    json.dumps(rec)


def test_a_server_that_exits_or_never_answers_fails_within_its_deadline(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("CUDA out of memory\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*CUDA out of memory"):
        peer2.wait_ready("http://127.0.0.1:9", dead, 30, log)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with pytest.raises(TimeoutError, match="not ready after 1 s"):
            peer2.wait_ready(f"http://127.0.0.1:{peer2._free_port()}", alive, 1, log)
    finally:
        peer2.stop_server(alive, grace_s=5)
    assert alive.poll() is not None  # stopped, its whole group


def test_tree_attention_fallback_matches_attention_over_each_path():
    """Two samples sharing a 3-token prompt, packed as a trie: segment 0 is the prompt, segments 1 and 2 the two
    answers; each answer's queries see the prompt and their own earlier tokens only."""
    torch.manual_seed(0)
    H, D = 2, 4
    packed = torch.randn(7, H, D), torch.randn(7, H, D), torch.randn(7, H, D)  # prompt 0-2, answer A 3-4, B 5-6
    paths = [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]
    kv_index = torch.tensor([i for p in paths for i in p])
    cu_q, cu_k = torch.tensor([0, 3, 5, 7]), torch.tensor([0, 3, 8, 13])
    q, k, v = packed
    f = peer2.tree_attention_fallback().flash_attn_varlen_func
    out = f(q, k.index_select(0, kv_index), v.index_select(0, kv_index), cu_q, cu_k, 3, 5, causal=True)
    for seq in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):  # each sample alone, causal
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[seq].transpose(0, 1), k[seq].transpose(0, 1), v[seq].transpose(0, 1), is_causal=True).transpose(0, 1)
        assert torch.allclose(out[seq], ref, atol=1e-6)


def test_trl_reward_scores_text_and_conversations():
    assert peer2.trl_reward(["qk|", "qk|"], ["jih", "abc"]) == [1.0, 0.0]
    conv = peer2.trl_reward([[{"role": "user", "content": "qk|"}]], [[{"role": "assistant", "content": "jihx"}]])
    assert conv == [1.0]


@pytest.mark.timeout(400)
def test_capstone_jobs_run_on_cpu_and_the_result_summarizes(tmp_path, monkeypatch):
    """The capstone's disaggregated and async jobs through the real parent and children (tiny model, transformers
    engine, CPU): every step and its parts recorded, the ratios absent (no TRL), the saved result re-summarized."""
    monkeypatch.setenv("LABSUPPORT_RESULTS_DIR", str(tmp_path))
    argv = ["--device", "cpu", "--engine", "transformers", "--size", "tiny", "--jobs",
            "capstone:disaggregated,capstone:async", "--seeds", "0", "--steps", "4", "--prompts", "4", "--group",
            "4", "--lr", "1e-3", "--eval-every", "2", "--skip", "1", "--capstone-config", "fast", "--gpus", "2",
            "--timeout", "300", "--out-name", "bench_peer2_test"]
    assert peer2.main(argv) == 0
    [path] = list(tmp_path.glob("bench_peer2_test.*.json"))
    data = json.loads(path.read_text())["data"]
    assert [r["job"] for r in data["runs"]] == ["capstone:disaggregated", "capstone:async"]
    for r in data["runs"]:
        assert "error" not in r and len(r["steps"]) == 4 and r["steps"][0]["train"] > 0
        assert [c["step"] for c in r["curve"]] == [0, 2, 4]
    asy = data["runs"][1]
    assert asy["staleness_histogram"] == {"0": 16, "1": 48} and len(asy["overlap"]) == 3
    assert data["pairs"]["async"]["mean"] is None and set(data["architectures"]) == {"disaggregated", "async"}
    assert peer2.main(["--summarize", str(path)]) == 0
    assert json.loads(path.read_text())["data"]["architectures"] == data["architectures"]
    # runs saved apart (another seed, another half hour) make one record; the same run twice does not
    rec = json.loads(path.read_text())
    for r in rec["data"]["runs"]:
        r["seed"] = 1
    rec["data"]["settings"]["seeds"] = "1"
    other = tmp_path / "seed1.json"
    other.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="recorded twice"):
        peer2.main(["--summarize", str(other), str(other)])
    assert peer2.main(["--summarize", str(path), str(other)]) == 0
    both = json.loads((tmp_path / f"bench_peer2.{rec['machine_tag']}.json").read_text())
    assert both["data"]["settings"]["seeds"] == "0,1" and len(both["data"]["runs"]) == 4
    assert set(both["data"]["architectures"]) == {"disaggregated", "async"}
