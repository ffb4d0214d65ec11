"""A gloo backend for vLLM's native weight-transfer API, so ``WeightTransferConfig`` code runs without CUDA.

That API's four phases are in Lab 4; vLLM's backends for them need a GPU. ``register_plugin`` adds
``"labsupport_gloo"`` to both of vLLM's factories: engines built like vLLM's NCCL one, over ``labsupport.broadcast``.
Importing this module registers nothing: vLLM calls ``register_plugin`` in each of its processes through the
package's ``vllm.general_plugins`` entry point (``pip install -e .``), and ``vllm_ext.native_trainer`` calls it
on the trainer.

Two differences from vLLM's NCCL engine, on purpose: its ``start_weight_update`` moves the model to the meta
device *before* the transfer, so a failed transfer leaves it unusable, while here the update is checked and
staged first (``labsupport.vllm_weights``) and loaded in ``finish_weight_update``; and a failed update does
not raise on the workers (vLLM discards the workers' replies and 0.32 mis-orders them after an error, see
``vllm_ext.WorkerFailed``): the trainer's ``send_weights`` raises the reason (every rank votes) and nothing loads.
After a timeout the group is aborted on every rank: the next ``send_weights`` says to create a new trainer.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer import base as vllm_wt

from labsupport import broadcast, groups
from labsupport.broadcast import SyncTimeout, WeightSyncError
from labsupport.core.buckets import metas
from labsupport.vllm_weights import GLOO_BACKEND, EngineWeights, _worker_rank

BUCKET_BYTES = 64 << 20
TIMEOUT_S = 60.0  # joining the group, and each phase of an update
logger = logging.getLogger(__name__)


# ---- Worker side ---------------------------------------------------------------------------------------

@dataclass
class GlooWeightTransferInitInfo(vllm_wt.WeightTransferInitInfo):
    """Worker-side init info (the trainer engine fills it in; the fields of vLLM's NCCL one)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = TIMEOUT_S  # any wait for the trainer; then SyncTimeout and the group is aborted


@dataclass
class GlooWeightTransferUpdateInfo(vllm_wt.WeightTransferUpdateInfo):
    """Per-round metadata (as vLLM's NCCL engine takes it), checked before any byte is received."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have one entry per tensor; got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(vllm_wt.WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: join the trainer's group, receive each update into staging, load it in ``finish``."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False
    group: groups.StatelessGroup | None = None
    weights: EngineWeights | None = None  # the model in checkpoint format, built at init
    open = False  # between start_weight_update and finish_weight_update

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        # Built now, not at engine start-up: a model this engine cannot check fails here, before any send.
        self.weights = EngineWeights(self.model, self.vllm_config, torch.device("cpu"))
        rank = _worker_rank(self.vllm_config, init_info.rank_offset)
        self.group = groups.create_group(init_info.master_address, init_info.master_port, rank,
                                         init_info.world_size, device="cpu", timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        self.weights.pending.clear()  # nothing touches the model until finish_weight_update
        self.open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if not self.open:
            raise RuntimeError("update_weights called outside start_weight_update/finish_weight_update")
        ew = self.weights
        if self.group.closed:  # aborted by a timeout: the trainer's send_weights raises, nothing to receive
            logger.error("weight update skipped: the group was aborted after a timeout; re-create it "
                         "(init_weight_transfer_engine, i.e. a new trainer engine)")
            return
        load = ew.loader(update_info.names, update_info.dtype_names, update_info.shapes)  # refuses in the vote
        try:
            broadcast.receive(self.group, src=0, expected=ew.expected, load=load, device="cpu")
        except WeightSyncError as exc:  # not raised (module docstring): the trainer's send raises it
            lost = isinstance(exc, SyncTimeout)  # a peer stopped answering: the group is aborted for good
            logger.log(logging.ERROR if lost else logging.WARNING, "weight update %s, model unchanged: %s",
                       "timed out (group aborted)" if lost else "refused", exc)
            ew.pending.clear()  # so finish_weight_update loads nothing

    def finish_weight_update(self) -> None:
        if not self.open:
            return
        try:
            if self.weights.pending:
                self.weights.flush(only_complete=False)
        finally:
            self.weights.pending.clear()
            self.open = False

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


# ---- Trainer side --------------------------------------------------------------------------------------

@dataclass
class GlooTrainerInitInfo(vllm_wt.TrainerInitInfo):
    """Trainer-side init info for ``labsupport_gloo`` (like vLLM's ``NCCLTrainerInitInfo``)."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = TIMEOUT_S  # (both ends of the group)


class GlooTrainerWeightTransferEngine(vllm_wt.TrainerWeightTransferEngine):  # unsubscripted: 0.26's takes 2 types
    """Trainer side, rank 0: ``send_weights()`` runs one update round through ``client``, replaying ``source``."""

    init_info_cls = GlooTrainerInitInfo
    group: groups.StatelessGroup | None = None
    version = 0  # of the last update sent

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                     source: Any = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource, e.g. ModuleSource(model)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, 1,
                                                 init_info.world_size, init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers wait for rank 0 (us) in their init
            joining = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = groups.create_group(init_info.master_address, init_info.master_port, 0,
                                                   init_info.world_size, device="cpu", timeout_s=init_info.timeout_s)
            finally:
                joining.result()
        return engine

    def send_weights(self) -> None:
        pairs = list(self.source)  # materialises FSDP shards on every rank (a collective)
        if not self.is_sender:
            return
        if self.group is None or self.group.closed:  # a timeout aborted it (on the engine's workers too)
            raise groups.GroupError(f"the weight-transfer group is gone (aborted after a timeout in update "
                                    f"v{self.version}, or shut down); nothing was sent. Create a new trainer engine "
                                    "(vllm_ext.native_trainer / trainer_init): the engine joins a new group.")
        pairs = [(n, t.detach().to("cpu")) for n, t in pairs]
        meta = metas(pairs)
        update_info = GlooWeightTransferUpdateInfo([m.name for m in meta], [m.dtype for m in meta],
                                                   [list(m.shape) for m in meta])
        self.version += 1
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers receive while we send
            receiving = pool.submit(self.client.update_weights, asdict(update_info))
            try:
                broadcast.send(self.group, pairs, src=0, mode="bucketed", bucket_bytes=BUCKET_BYTES,
                               version=self.version)
            finally:  # a refusal (WeightSyncError) too: every rank voted, so the workers have returned
                receiving.result(timeout=self.group.timeout_s + 30)  # surface a worker-side error
                self.client.finish_weight_update()  # close their session (a refused one loads nothing)

    shutdown = GlooWeightTransferEngine.shutdown  # leave the group


# ---- Registration --------------------------------------------------------------------------------------

def register_plugin() -> None:
    """Register ``labsupport_gloo`` with both of vLLM's factories (which record the module path only); the
    ``vllm.general_plugins`` entry point. Idempotent: vLLM may call it more than once per process, and so may we."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        with contextlib.suppress(ValueError):  # already registered in this process
            factory.register_engine(GLOO_BACKEND, __name__, cls)

