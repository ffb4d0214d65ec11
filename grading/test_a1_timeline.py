"""Assignment 1 (assignments/a1_timeline.py): a memory timeline of one RLHF step by role, and its plot.

A small step runs under the timeline: generate (a KV cache appears), free the KV cache, train (gradients
appear), optimizer step (Adam's two moments appear, gradients go). Bytes are checked exactly at every edge.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

ROLES = ["weights", "gradients", "optimizer", "kv_cache"]


def one_step(impl, device: str = "cpu"):
    """Run the step under a timeline of ``device``; returns the timeline and the weights' bytes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.Adam(model.parameters())
    kv: list[torch.Tensor] = []
    tl = impl.Timeline(device)
    tl.track("weights", lambda: list(model.parameters()))
    tl.track("gradients", lambda: [p.grad for p in model.parameters() if p.grad is not None])
    tl.track("optimizer", lambda: [t for s in opt.state.values() for t in s.values() if t.dim()])
    tl.track("kv_cache", lambda: kv)
    with tl.phase("generate"):
        kv.append(torch.zeros(1000, device=device))
        kv.append(torch.zeros(500, device="meta"))  # not on this device: does not count
    with tl.phase("free_kv"):
        kv.clear()
    with tl.phase("train"):
        model(torch.randn(8, 64, device=device)).sum().backward()
    with tl.phase("optimizer_step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tl, sum(p.nbytes for p in model.parameters())


def expected(w: int) -> list[tuple[str, str, dict[str, int]]]:
    """(phase, event, bytes by role) at every edge of the step."""
    zero = dict.fromkeys(ROLES, 0)
    return [("generate", "begin", {**zero, "weights": w}),
            ("generate", "end", {**zero, "weights": w, "kv_cache": 4000}),
            ("free_kv", "begin", {**zero, "weights": w, "kv_cache": 4000}),
            ("free_kv", "end", {**zero, "weights": w}),
            ("train", "begin", {**zero, "weights": w}),
            ("train", "end", {**zero, "weights": w, "gradients": w}),
            ("optimizer_step", "begin", {**zero, "weights": w, "gradients": w}),
            ("optimizer_step", "end", {**zero, "weights": w, "optimizer": 2 * w})]


def check_bytes(tl, w: int) -> None:
    got = [(s["phase"], s["event"], dict(s["roles"])) for s in tl.samples]
    want = expected(w)
    assert len(got) == len(want), f"expected {len(want)} samples (a begin and an end per phase), got {len(got)}"
    for g, e in zip(got, want):
        assert g == e, f"at {e[0]}/{e[1]}: expected bytes by role {e[2]}, got {g[0]}/{g[1]} {g[2]}"


@pytest.mark.points(4)
def test_bytes_by_role_at_every_phase_edge(impl):
    tl, w = one_step(impl)
    check_bytes(tl, w)


@pytest.mark.points(2)
def test_samples_and_phases(impl):
    tl, _ = one_step(impl)
    want = ["generate", "free_kv", "train", "optimizer_step"]
    assert tl.phases == want, f"expected the phases {want} in order, got {tl.phases}"
    ts = [s["t"] for s in tl.samples]
    assert all(isinstance(t, float) for t in ts) and ts == sorted(ts), f"expected non-decreasing seconds, got {ts}"
    assert all(s["allocated"] is None for s in tl.samples), "expected allocated None on the CPU"
    assert all(list(s["roles"]) == ROLES for s in tl.samples), "expected every role, in the order tracked"


@pytest.mark.points(4)
def test_plot_stacks_the_roles(impl):
    tl, _ = one_step(impl)
    ax = impl.plot(tl, unit=1e3)
    texts = [t.get_text() for t in ax.texts]
    assert texts == tl.phases, f"expected the phase names {tl.phases} written on the plot, got {texts}"
    bars = {c.get_label(): c for c in ax.containers}
    assert list(bars) == ROLES, f"expected one bar series per role, labelled {ROLES}, got {list(bars)}"
    bottom = [0.0] * len(tl.samples)
    for role in ROLES:
        patches = bars[role].patches
        heights = [p.get_height() for p in patches]
        want = [s["roles"][role] / 1e3 for s in tl.samples]
        assert heights == pytest.approx(want), f"{role}: expected heights {want} (bytes / unit), got {heights}"
        ys = [p.get_y() for p in patches]
        assert ys == pytest.approx(bottom), f"{role}: expected it stacked on the roles before it at {bottom}, got {ys}"
        bottom = [b + h for b, h in zip(bottom, want)]
    labels = [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
    assert labels[:len(ROLES)] == ROLES, f"expected a legend naming the roles, got {labels}"


@pytest.mark.gpu(1)
@pytest.mark.points(4)
def test_gpu_timeline_reads_the_allocator(impl):
    tl, w = one_step(impl, "cuda")
    check_bytes(tl, w)
    assert all(isinstance(s["allocated"], int) for s in tl.samples), "expected the allocator's bytes on a GPU"
    kv = next(s for s in tl.samples if s["phase"] == "generate" and s["event"] == "end")
    assert kv["allocated"] >= w + 4000, \
        f"expected at least the weights and the KV cache allocated ({w + 4000} bytes), got {kv['allocated']}"
    freed = next(s for s in tl.samples if s["phase"] == "free_kv" and s["event"] == "end")
    assert kv["allocated"] - freed["allocated"] >= 4000, (  # reserved memory would not drop: the cache keeps it
        f"expected the allocated bytes to drop by the KV cache's 4000 once it is freed, got {kv['allocated']} "
        f"then {freed['allocated']} (torch.cuda.memory_allocated, not memory_reserved)")


@pytest.mark.points(2)
def test_a_phase_that_raises_is_still_closed(impl):
    """An out-of-memory error inside a phase is the moment a timeline is read: the phase still gets its end
    sample, the error reaches the caller unchanged, and the next phase is recorded as usual."""
    kv: list[torch.Tensor] = []
    tl = impl.Timeline("cpu")
    tl.track("kv_cache", lambda: kv)
    with pytest.raises(MemoryError, match="out of memory"):
        with tl.phase("generate"):
            kv.append(torch.zeros(250))
            raise MemoryError("out of memory")
    with tl.phase("train"):
        kv.clear()
    got = [(s["phase"], s["event"], s["roles"]["kv_cache"]) for s in tl.samples]
    want = [("generate", "begin", 0), ("generate", "end", 1000), ("train", "begin", 1000), ("train", "end", 0)]
    assert got == want, f"expected the samples {want} (the raising phase closed), got {got}"
    assert tl.phases == ["generate", "train"], f"expected the phases ['generate', 'train'], got {tl.phases}"


@pytest.mark.points(2)
def test_a_view_counts_its_own_bytes_and_roles_are_read_at_each_sample(impl):
    """A role holding a slice of a larger tensor (a shard of a fused weight) holds the slice's bytes, not its
    storage's; a role's tensors are asked for at every sample, not once when tracked."""
    fused = torch.zeros(100, 10)  # 4000 bytes
    held: list[torch.Tensor] = [fused[:10]]  # 400 bytes of it
    tl = impl.Timeline("cpu")
    tl.track("shard", lambda: list(held))
    with tl.phase("a"):
        held.append(torch.zeros(25, dtype=torch.float64))  # 200 more
    got = [s["roles"]["shard"] for s in tl.samples]
    assert got == [400, 600], \
        f"expected the shard's bytes [400, 600] (a view's own bytes, read at each sample), got {got}"


@pytest.mark.points(1)
def test_times_count_from_the_timelines_creation(impl):
    import time

    tl = impl.Timeline("cpu")
    time.sleep(0.05)
    with tl.phase("a"):
        pass
    t = tl.samples[0]["t"]
    assert 0.05 <= t < 60, f"expected the first sample about 0.05 s after the timeline was made, got t = {t}"
