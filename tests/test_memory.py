"""MemoryTimeline: role accounting, phases, the sampler thread, plots, and the demo RLHF step."""
import gc
import json
import pickle
import time

import pytest
import torch

from labsupport import memory as M
from labsupport.bench import memory as memory_bench
from labsupport.course import hardware, planner
from labsupport.experiments import memory_report, strategies as S


def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def test_role_totals_equal_registered_tensor_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    kv = [torch.zeros(2, 4, 16), torch.zeros(2, 4, 16)]
    extra = torch.ones(100, dtype=torch.float64)
    tl = M.MemoryTimeline("cpu")
    tl.register("weights", model)
    tl.register("gradients", model)
    tl.register("optimizer", opt)
    tl.register("kv_cache", kv)
    tl.register("other", lambda: [extra, model[0].weight[:3]])  # a view of a weight must not count twice
    roles, host = tl.role_bytes()
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    assert roles["weights"] == nbytes(params)
    assert roles["gradients"] == nbytes([p.grad for p in params])
    assert roles["optimizer"] == nbytes(state)  # exp_avg, exp_avg_sq and the step counters
    assert roles["kv_cache"] == nbytes(kv) == 2 * 2 * 4 * 16 * 4
    assert roles["other"] == 800 and roles["activations"] == 0 and host == 0
    s = tl.sample()
    assert memory_report.role_total(s) == sum(roles.values()) and "allocated" not in s  # no allocator on CPU
    kv.clear()  # a cleared list shows up at the next sample
    assert tl.role_bytes()[0]["kv_cache"] == 0


def test_same_storage_counts_once_under_first_role():
    w = torch.zeros(10, 10)
    tl = M.MemoryTimeline("cpu")
    tl.register("activations", [w.t()])
    tl.register("weights", [w])
    roles, _ = tl.role_bytes()
    assert roles["weights"] == 400 and roles["activations"] == 0


def test_registered_tensor_is_not_kept_alive():
    t = torch.zeros(1000)
    tl = M.MemoryTimeline("cpu")
    tl.register("other", t, name="scratch")
    assert tl.role_bytes()[0]["other"] == 4000
    del t
    gc.collect()
    assert tl.role_bytes()[0]["other"] == 0
    tl.unregister("scratch")
    with pytest.raises(KeyError):
        tl.unregister("scratch")


def test_forget_sources_releases_registered_objects():
    import weakref
    model = torch.nn.Linear(8, 8)
    ref = weakref.ref(model)
    tl = M.MemoryTimeline("cpu")
    tl.register("weights", model)
    with tl.phase("p"):
        pass
    tl.forget_sources()
    del model
    gc.collect()
    assert ref() is None  # a finished timeline keeps its samples, not the model
    assert tl.samples[0]["roles"]["weights"] == 8 * 8 * 4 + 8 * 4
    assert {"role": "weights", "name": "Linear"} in tl.to_dict()["sources"]


def test_bad_registration_is_rejected():
    tl = M.MemoryTimeline("cpu")
    with pytest.raises(ValueError, match="kv_cache"):
        tl.register("kvcache", [])
    with pytest.raises(TypeError, match="callable"):
        tl.register("other", 42)


def test_activations_counted_while_graph_alive():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64, requires_grad=True)
    tl = M.MemoryTimeline("cpu")
    tl.register("weights", lin)
    with tl.track_activations():
        h = torch.relu(lin(x))
        y = (h * h).sum()
    during = tl.role_bytes()[0]
    # x and h (128 x 64 fp32 each) are saved for backward; the weight stays a weight
    assert during["activations"] >= 2 * 128 * 64 * 4
    assert during["weights"] == nbytes(lin.parameters())
    y.backward()
    del y, h, x  # x was saved too: it lives as long as the test holds it
    gc.collect()
    assert tl.role_bytes()[0]["activations"] == 0


def test_phases_recorded_in_order_without_overlap():
    tl = M.MemoryTimeline("cpu")
    for name in ["generate", "reward", "train"]:
        with tl.phase(name):
            time.sleep(0.01)
    names = list(tl.phases)
    assert names == ["generate", "reward", "train"]
    spans = tl.to_dict()["phases"]
    for p in spans:
        assert p["start"] < p["end"]
    for a, b in zip(spans, spans[1:]):
        assert a["end"] <= b["start"]
    assert [s["event"] for s in tl.samples] == ["begin", "end"] * 3
    assert [s["phase"] for s in tl.samples[::2]] == names
    with tl.phase("outer"):
        with pytest.raises(RuntimeError, match="overlap"):
            with tl.phase("inner"):
                pass
    assert tl.phases[-1] == "outer"
    rows = memory_report.peak_by_phase(tl)
    assert [r["phase"] for r in rows] == names + ["outer"]
    json.dumps(tl.to_dict())  # JSON-able as is


def test_memory_timeline_is_the_core_timeline_with_additions():
    """One vocabulary: the hardened timeline is a core Timeline (roles through track(), phases by name, samples with
    the core's keys), and a phase that raises still gets its end sample, so its span is recorded."""
    from labsupport.core import timeline

    w = torch.zeros(10)
    tl = M.MemoryTimeline("cpu")
    assert isinstance(tl, timeline.Timeline)
    tl.register("weights", [w], name="w")
    assert set(tl.roles) == {"activations", "weights"} and [t.nbytes for t in tl.roles["weights"]()] == [40]
    with pytest.raises(ZeroDivisionError):
        with tl.phase("fails"):
            1 / 0
    assert tl.phases == ["fails"] and [s["event"] for s in tl.samples] == ["begin", "end"]
    assert {"t", "phase", "event", "roles"} <= set(tl.samples[1]) and tl.samples[1]["roles"]["weights"] == 40
    assert [p["name"] for p in tl.to_dict()["phases"]] == ["fails"]
    with tl.phase("next"):  # the failed phase is over: no overlap
        pass


def test_rlhf_step_records_on_the_core_timeline_too():
    """rlhf_step takes either timeline: the core one samples at phase edges only (no activations, no marks)."""
    from labsupport.core import timeline

    state = S.make_state("kv_freed")
    try:
        S.rlhf_step(state)
        core = timeline.Timeline("cpu")
        core.track("kv_cache", lambda: state.kv)
        S.rlhf_step(state, core)
        assert core.phases == ["generate", "free_kv", "reward", "train", "optimizer_step"]
        assert [s["event"] for s in core.samples] == ["begin", "end"] * 5
        assert core.samples[1]["roles"]["kv_cache"] > 0 and core.samples[3]["roles"]["kv_cache"] == 0
    finally:
        S.release_state(state)


def _check_sampler(device):
    """The thread ticks (GPU) or never starts (CPU), stops cleanly, and never reads the registered tensors:
    only the step's own thread counts roles, at phase edges and marks."""
    import threading
    t = torch.zeros(1000, device=device)
    readers = set()

    def tensors():
        readers.add(threading.get_ident())
        return [t]

    tl = M.MemoryTimeline(device, interval_s=0.005)
    tl.register("other", tensors)
    with tl.sampling():
        assert tl.sampling_active == tl.gpu
        if tl.gpu:
            with pytest.raises(RuntimeError, match="already running"):
                tl.start()
        with tl.phase("p"):
            time.sleep(0.15)
            tl.sample("forward")
    assert not tl.sampling_active
    assert readers == {threading.get_ident()}  # never the sampler thread
    ticks = [s for s in tl.samples if s["event"] == "tick"]
    assert all("roles" not in s for s in ticks) and (len(ticks) >= 5 if tl.gpu else not ticks)
    assert [s["event"] for s in tl.samples if "roles" in s] == ["begin", "forward", "end"]
    assert all(s["roles"]["other"] == 4000 for s in tl.samples if "roles" in s and not tl.gpu)
    n = len(tl.samples)
    time.sleep(0.05)
    assert len(tl.samples) == n  # nothing after stop
    with pytest.raises(ZeroDivisionError):  # an error in the block still stops the thread
        with tl.sampling():
            1 / 0
    assert not tl.sampling_active
    tl.stop()  # stopping a stopped sampler is harmless


def test_background_sampler_never_reads_the_steps_tensors():
    _check_sampler("cpu")


@pytest.mark.gpu(1)
@pytest.mark.skipif(hardware.gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_gpu_background_sampler_ticks_and_stops():
    _check_sampler("cuda")


STRESS = """
import sys, time, torch
from labsupport import memory
from labsupport.course import models
model = models.build_model(seed=0).to(sys.argv[1])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
tl = memory.MemoryTimeline(sys.argv[1], interval_s=0.0001)
tl.register("weights", model); tl.register("gradients", model); tl.register("optimizer", opt)
x = torch.randint(3, model.config.vocab_size, (4, 16), device=sys.argv[1])
t0, n = time.time(), 0
with tl.sampling():
    while time.time() - t0 < 8:
        with tl.track_activations():
            model(x).logits.float().mean().backward()
        opt.step(); opt.zero_grad(set_to_none=True); n += 1
print("steps", n)
"""


@pytest.mark.gpu(1)
@pytest.mark.skipif(hardware.gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_gpu_allocator_ticks_through_backward_and_zero_grad():
    """The sampler thread used to count roles by reading p.grad and storages while autograd and
    zero_grad(set_to_none=True) freed them; on CPU that segfaulted within seconds (lab 2 in CI: a dead kernel).
    Now it reads only the allocator: run it at 10 kHz through training steps, in a process of its own."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", STRESS, "cuda"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("steps"), r.stderr[-2000:]


def test_memory_history_needs_gpu_on_cpu():
    tl = M.MemoryTimeline("cpu")
    with pytest.raises(RuntimeError, match="GPU"):
        tl.start_history()
    with pytest.raises(RuntimeError, match="start_history"):
        tl.save_snapshot("/tmp/never.pickle")


def test_rlhf_step_roles_match_planner_and_strategies_order():
    cfg = S.CPU_CONFIG
    tls = {}
    for s in ("resident", "kv_freed"):
        tls[s], info = S.run_strategy(s, cfg, "cpu")
        assert info["params"] > 0
    d = tls["kv_freed"].to_dict()
    assert [p["name"] for p in d["phases"]] == ["generate", "free_kv", "reward", "train", "optimizer_step"]
    end_of = {s["phase"]: s for s in d["samples"] if s["event"] == "end"}
    kv = planner.kv_cache_bytes(cfg.layers, cfg.kv_heads, 64, cfg.kv_len, cfg.batch, "fp32")
    assert end_of["generate"]["roles"]["kv_cache"] == kv
    assert end_of["free_kv"]["roles"]["kv_cache"] == 0
    n = info["params"]
    model = S.make_state("kv_freed", cfg).model
    n_tensors = len(list(model.parameters()))
    buffers = sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}.values())
    assert end_of["generate"]["roles"]["weights"] == 4 * n + buffers  # fp32 parameters + rotary buffers
    # Adam: two fp32 moments per parameter plus one 4-byte step counter per parameter tensor
    opt_bytes = end_of["generate"]["roles"]["optimizer"]
    assert opt_bytes == 8 * n + 4 * n_tensors
    assert end_of["train"]["roles"]["gradients"] == 4 * n
    assert end_of["optimizer_step"]["roles"]["gradients"] == 0  # freed with set_to_none
    train_peak = max(memory_report.role_total(s) for s in d["samples"] if s["phase"] == "train")
    assert train_peak > end_of["reward"]["roles"]["weights"] + opt_bytes  # activations and grads showed up
    r = tls["resident"].to_dict()
    assert "free_kv" not in [p["name"] for p in r["phases"]]
    assert memory_report.peak_bytes(r) > memory_report.peak_bytes(d)  # keeping the KV pool raises the peak


def test_plots_side_by_side_share_y(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    tl = M.MemoryTimeline("cpu", name="x")
    tl.register("kv_cache", [torch.zeros(1000)])
    with tl.phase("generate"):
        pass
    fig = memory_report.plot_timelines({"a": tl, "b": tl.to_dict()}, unit=1e3)
    a, b = fig.axes[:2]
    assert a.get_shared_y_axes().joined(a, b)
    texts = [t.get_text() for t in a.texts]
    assert any("allocator lines n/a" in t for t in texts) and any("peak 4 " in t for t in texts)
    fig.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_bench_cpu_writes_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABSUPPORT_RESULTS_DIR", str(tmp_path))
    from labsupport.course import results
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    assert memory_bench.main(["--device", "cpu", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "sampler overhead" in out and "resident" in out
    rec = json.loads((tmp_path / "memory_timeline.cpu.json").read_text())
    data = rec["data"]
    assert set(data["strategies"]) == set(S.STRATEGIES)
    assert data["peaks"]["resident"] > data["peaks"]["kv_freed"]
    assert (tmp_path / "memory_timeline.cpu.png").exists()


def _trained_adam(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and Adam after three steps: moments and step counters hold non-trivial values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for seed in range(3):
        _adam_step(model, opt, device, seed)
    return model, opt


def _adam_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g).to(device)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().cpu().clone() for k, v in opt.state[p].items()} for p in opt.param_groups[0]["params"]]


def _check_round_trip(device: str) -> None:
    """Offload Adam's state to host memory and back: values bit-identical, and the next step is the same."""
    model, opt = _trained_adam(device)
    ref_model, ref_opt = _trained_adam(device)  # the same run, never moved
    before = _state(opt)
    n = sum(p.numel() for p in model.parameters())
    assert M.move_optimizer_state(opt, "cpu") == 2 * 4 * n  # exp_avg and exp_avg_sq, fp32
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert all(v.device.type == "cpu" and v.is_pinned() for v in moments)
    assert M.move_optimizer_state(opt, device) == 2 * 4 * n
    assert all(v.device.type == "cuda" for s in opt.state.values() for k, v in s.items() if k != "step")
    after = _state(opt)
    assert [sorted(s) for s in after] == [["exp_avg", "exp_avg_sq", "step"]] * len(before)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(after, before) for k in a)  # bit-identical, step too
    _adam_step(model, opt, device, 3)
    _adam_step(ref_model, ref_opt, device, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_optimizer_state_already_in_place_is_not_copied():
    """On the CPU path the state is already in host memory: nothing moves, the same tensors stay, the run is
    unchanged. (The host round trip itself needs a GPU: test_gpu_optimizer_state_round_trip_is_exact.)"""
    model, opt = _trained_adam("cpu")
    ref_model, ref_opt = _trained_adam("cpu")
    held = [dict(s) for s in opt.state.values()]
    assert M.move_optimizer_state(opt, "cpu") == 0
    assert all(opt.state[p][k] is held[i][k] for i, p in enumerate(opt.state) for k in held[i])
    _adam_step(model, opt, "cpu", 3)
    _adam_step(ref_model, ref_opt, "cpu", 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


@pytest.mark.gpu(1)
@pytest.mark.skipif(hardware.gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_gpu_optimizer_state_round_trip_is_exact():
    _check_round_trip("cuda")


@pytest.mark.gpu(2)
@pytest.mark.skipif(hardware.gpu_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_optimizer_state_round_trip_off_the_current_device():
    """The state lives on cuda:1 while cuda:0 is current: the copies must be waited for on cuda:1."""
    torch.cuda.set_device(0)
    _check_round_trip("cuda:1")


@pytest.mark.gpu(1)
@pytest.mark.skipif(hardware.gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_gpu_allocator_tracks_known_allocation_and_snapshot(tmp_path):
    tl = M.MemoryTimeline("cuda")
    held = []
    tl.register("kv_cache", held)
    tl.start_history()
    before = torch.cuda.memory_allocated()
    with tl.sampling():
        with tl.phase("alloc"):
            held.append(torch.ones(256 << 20, dtype=torch.uint8, device="cuda"))
            time.sleep(0.05)
        with tl.phase("free"):
            held.clear()
            time.sleep(0.05)
    path = tl.save_snapshot(tmp_path / "snap.pickle")
    d = tl.to_dict()
    end_alloc = next(s for s in d["samples"] if s["phase"] == "alloc" and s["event"] == "end")
    assert end_alloc["allocated"] - before >= 256 << 20
    assert end_alloc["roles"]["kv_cache"] == 256 << 20
    assert d["phases"][0]["peak_allocated"] - before >= 256 << 20
    end_free = next(s for s in d["samples"] if s["phase"] == "free" and s["event"] == "end")
    assert end_free["allocated"] - before < 1 << 20 and end_free["roles"]["kv_cache"] == 0
    assert any(s["event"] == "tick" and "allocated" in s for s in d["samples"])
    snap = pickle.loads(path.read_bytes())
    assert "segments" in snap and path.stat().st_size > 0


@pytest.mark.gpu(1)
@pytest.mark.skipif(hardware.gpu_count() < 1, reason="needs 1 CUDA GPU")
def test_gpu_strategies_peaks_order():
    peaks = {s: memory_report.peak_bytes(S.run_strategy(s, S.GPU_CONFIG, "cuda")[0]) for s in S.STRATEGIES}
    assert peaks["offloaded"] < peaks["kv_freed"] < peaks["resident"]
