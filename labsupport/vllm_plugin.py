"""vLLM's native weight-transfer API from the trainer's side (:func:`native_trainer`, on vLLM 0.32
or 0.26), and a gloo backend so that code written against ``WeightTransferConfig`` runs without
CUDA (Lab 4). ``register_plugin`` (the ``vllm.general_plugins`` entry point; importing registers
nothing) adds ``"labsupport_gloo"``: vLLM's NCCL engines over ``labsupport.broadcast``, except that
an update is checked, staged and loaded in ``finish_weight_update`` (vLLM's moves the model to the
meta device first: a failed transfer leaves it unusable), and a failed one does not raise on the
workers (0.32 mis-orders replies after a worker error, ``vllm_weights.worker_rpc``): every rank
votes, the trainer's ``send_weights`` raises the reason, nothing loads (nor where a load fails on
one rank: ``load_vote``). A timeout aborts the group on every rank (the next ``send_weights`` says
to create a new trainer). Every engine call of a round has a deadline (``EngineTimeout``, then
``vllm_ext.EngineUnusable``), as do the NCCL trainer's set-up and send (0.26's and 0.32's).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer import base as vllm_wt, factory

from labsupport import broadcast, groups, vllm_ext
from labsupport.broadcast import SyncTimeout, WeightSyncError
from labsupport.course import versions
from labsupport.vllm_ext import announced
from labsupport.vllm_weights import EngineWeights, UpdateGroup, worker_rank

# WeightTransferConfig(backend=GLOO_BACKEND): vLLM's native API over gloo
GLOO_BACKEND = "labsupport_gloo"
BUCKET_BYTES = 64 << 20
TIMEOUT_S = 60.0  # joining the group, and each phase of an update
REPLY_S = 30.0  # how long the workers' call may take once the trainer's side is done
logger = logging.getLogger(__name__)


@dataclass
class GlooWeightTransferInitInfo(vllm_wt.WeightTransferInitInfo):
    """Worker-side init info (the trainer engine fills it in; the fields of vLLM's NCCL one)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = TIMEOUT_S  # any wait for the trainer; then SyncTimeout, the group aborted


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


class GlooWeightTransferEngine(vllm_wt.WeightTransferEngine[GlooWeightTransferInitInfo,
                                                             GlooWeightTransferUpdateInfo],
                               UpdateGroup):
    """Worker side: join the trainer's group, stage each update, load it in ``finish``."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False
    weights: EngineWeights | None = None  # the model in checkpoint format, built at init

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        # built now, not at engine start-up: a model this engine cannot check fails before any send
        self.weights = EngineWeights(self.model, self.vllm_config, torch.device("cpu"))
        self.join_group(init_info.master_address, init_info.master_port,
                        worker_rank(self.vllm_config, init_info.rank_offset), init_info.world_size,
                        device="cpu", timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        self.require_group("init_weight_transfer_engine")
        self.weights.pending.clear()  # nothing touches the model until finish_weight_update

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        ew = self.weights
        if self.group.closed:  # aborted by a timeout: the trainer's send_weights raises
            logger.error("weight update skipped: the group was aborted after a timeout; re-create "
                         "it (init_weight_transfer_engine, i.e. a new trainer engine)")
            return
        load = ew.loader(update_info.names, update_info.dtype_names, update_info.shapes)
        try:
            broadcast.receive(self.group, src=0, expected=ew.expected, load=load, device="cpu")
        except WeightSyncError as exc:  # a refusal (voted) or a timeout: the trainer's send raises
            lost = isinstance(exc, SyncTimeout)  # a peer stopped answering: the group is aborted
            logger.log(logging.ERROR if lost else logging.WARNING, "weight update %s, model "
                       "unchanged: %s", "timed out (group aborted)" if lost else "refused", exc)
            ew.pending.clear()  # so finish_weight_update loads nothing

    def finish_weight_update(self) -> None:  # (after start_weight_update: weights exist)
        """Load what was staged on every rank or none (``load_vote``): a failure is logged here, and
        raised by the trainer (a worker raising would put vLLM 0.32's later replies in disorder)."""
        ew = self.weights
        if not ew.pending:  # a refused or aborted update: nothing to load, and no vote
            return
        try:
            with ew.all_or_nothing():
                try:
                    ew.flush(only_complete=False)
                    problems = []
                except Exception as exc:  # (this rank's failed layer is back already)
                    problems = [f"{type(exc).__name__}: {exc}"]
                load_vote(self.group, problems)
        except WeightSyncError as exc:
            logger.error("weight update not loaded, model unchanged: %s", exc)

    shutdown = UpdateGroup.leave_group


@dataclass
class GlooTrainerInitInfo(vllm_wt.TrainerInitInfo):
    """Trainer-side init info for ``labsupport_gloo`` (like vLLM's ``NCCLTrainerInitInfo``)."""
    backend: ClassVar[str] = GLOO_BACKEND
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = TIMEOUT_S  # (both ends of the group)


class GlooTrainerWeightTransferEngine(vllm_wt.TrainerWeightTransferEngine, UpdateGroup):
    """Trainer side, rank 0: ``send_weights()`` sends ``source`` in one round through ``client``."""

    init_info_cls = GlooTrainerInitInfo
    version = 0  # of the last update sent

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                     source: Any = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("a gloo trainer engine needs a WeightSource, e.g. ModuleSource(model)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        info = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, 1,
                                          init_info.world_size, init_info.timeout_s)  # the workers'
        try:  # the workers wait for rank 0 (us) in their init
            vllm_ext.alongside(lambda: client.init_weight_transfer_engine(asdict(info)),
                               lambda: engine.join_group(info.master_address, info.master_port, 0,
                                                         info.world_size, device="cpu",
                                                         timeout_s=info.timeout_s),
                               info.timeout_s + REPLY_S)
        except BaseException:
            engine.leave_group()  # (the workers never confirmed: leave nothing behind)
            raise
        return engine

    def send_weights(self) -> None:
        pairs = [(n, t.detach().to("cpu")) for n, t in self.source]  # FSDP: a collective, all ranks
        if not self.is_sender:
            return
        if self.group is None or self.group.closed:  # a timeout aborted it (on the workers too)
            raise groups.GroupError("the weight-transfer group is gone (aborted after a timeout in "
                                    f"update v{self.version}, or shut down); nothing was sent. "
                                    "Create a new trainer engine (vllm_plugin.native_trainer / "
                                    "trainer_init): the engine joins a new group.")
        self.version += 1
        _session(self.client, announced(pairs), self.group.timeout_s + REPLY_S,  # refusals raise
                 lambda: broadcast.send(self.group, pairs, src=0, mode="bucketed",
                                        bucket_bytes=BUCKET_BYTES, version=self.version),
                 vote=lambda: load_vote(self.group, []))

    shutdown = UpdateGroup.leave_group  # (vLLM's base class has an empty one, first in the MRO)


def load_vote(group: groups.StatelessGroup, problems: list[str]) -> None:
    """A native update's last vote, the trainer's and every worker's after their loads: each
    rank's problems (the trainer's: none); ``WeightSyncError`` on every rank if any has one."""
    with broadcast.guard(group, "the load vote"):
        votes = group.all_gather_object(problems)
    if lines := [f"\n  rank {r}: {p}" for r, ps in enumerate(votes) for p in ps]:
        raise WeightSyncError("weight update not loaded: every engine rank put its old weights "
                              "back (nothing is half-loaded)" + "".join(lines))


def _session(client: Any, update_info: Any, timeout: float, send: Callable[[], Any],
             vote: Callable[[], Any] | None = None) -> None:
    """One round: start; the workers' ``update_weights`` alongside ``send``; finish (alongside
    ``vote``, if sent), whatever happened (an error: the trainer's, the others' attached). Any
    engine call past its deadline: ``EngineTimeout``, the engine unusable (no call beside it)."""
    engine = getattr(client, "llm", client)
    vllm_ext.check_usable(engine)
    vllm_ext.within(client.start_weight_update, timeout, "start_weight_update", engine)
    try:
        vllm_ext.alongside(lambda: client.update_weights(update_info), send, timeout, engine)
    except BaseException as exc:
        try:  # with a deadline: workers still in update_weights would hold it up
            vllm_ext.within(client.finish_weight_update, vllm_ext.GRACE_S, "finish_weight_update",
                            engine)
        except Exception as also:
            exc.add_note(f"finish_weight_update failed too: {type(also).__name__}: {also}")
        raise
    finish = functools.partial(vllm_ext.within, client.finish_weight_update, timeout,
                               "finish_weight_update", engine)
    if vote is None:
        return finish()
    vllm_ext.alongside(finish, vote, timeout + vllm_ext.GRACE_S)  # (finish's deadline fires first)


def register_plugin() -> None:
    """The ``vllm.general_plugins`` entry point: ``labsupport_gloo`` into both of vLLM's factories
    (by module path). Idempotent: vLLM may call it more than once per process, and so may we."""
    for each, cls in ((factory.WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                      (factory.WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        if GLOO_BACKEND not in each._registry:  # (any other refusal raises)
            each.register_engine(GLOO_BACKEND, __name__, cls)


def native_backend(device: str | torch.device) -> str:
    """The native backend for a trainer on ``device``: vLLM's ``"nccl"``, or our gloo one."""
    return "nccl" if torch.device(device).type == "cuda" else GLOO_BACKEND


def native_trainer(device: str | torch.device, master_address: str, master_port: int,
                   world_size: int, *, client: Any, source: Any,
                   timeout: float = vllm_ext.TIMEOUT_S) -> Any:
    """The trainer's end of vLLM's native API (``send_weights()``, ``source``, ``shutdown()``):
    0.32's ``WeightTransferTrainerFactory.trainer_init``, or on 0.26 :class:`NcclTrainer026`."""
    if native_backend(device) == GLOO_BACKEND:
        register_plugin()  # the trainer's factory must know it (the engine's: the entry point)
        info = GlooTrainerInitInfo(master_address, master_port, world_size, rank=0)
        return factory.WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    if not versions.has_nccl_trainer():  # vLLM 0.26
        return NcclTrainer026.trainer_init(master_address, master_port, world_size, True, client,
                                           source, timeout)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    info = NCCLTrainerInitInfo(master_address, master_port, world_size, rank=0)  # packed
    engine = getattr(client, "llm", client)  # vLLM's waits on NCCL and its client with no deadline:
    trainer = vllm_ext.within(lambda: factory.WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=source), timeout, "NCCL trainer_init", engine)  # ours
    send = trainer.send_weights

    def send_weights() -> None:
        vllm_ext.check_usable(engine)  # (not beside a send that timed out)
        vllm_ext.within(send, timeout, "NCCL send_weights", engine)
    trainer.send_weights = send_weights
    return trainer


class NcclTrainer026:
    """vLLM 0.26's trainer side of ``"nccl"`` in 0.32's shape, over ``NCCLWeightTransferEngine``'s
    static helpers; its NCCL calls (no deadline in vLLM) run on a thread within ``timeout``."""

    def __init__(self, group: Any, packed: bool, client: Any, source: Any,
                 timeout: float = vllm_ext.TIMEOUT_S) -> None:
        self.group, self.packed, self.client, self.source = group, packed, client, source
        self.timeout = timeout

    @classmethod
    def trainer_init(cls, master_address: str, master_port: int, world_size: int, packed: bool,
                     client: Any, source: Any, timeout: float = vllm_ext.TIMEOUT_S) -> Self:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Nccl

        info = dict(master_address=master_address, master_port=master_port, world_size=world_size)
        group, _ = vllm_ext.alongside(  # the workers wait for rank 0
            lambda: client.init_weight_transfer_engine({**info, "rank_offset": 1}),
            lambda: vllm_ext.within(lambda: Nccl.trainer_init(info), timeout, "NCCL trainer_init"),
            timeout)
        return cls(group, packed, client, source, timeout)

    def send_weights(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Nccl

        if self.group is None:
            raise groups.GroupError("this trainer's communicator is gone (shut down, or aborted "
                                    "after a timeout); nothing was sent. Create a new trainer "
                                    "engine (vllm_plugin.native_trainer).")
        pairs = [(n, t.detach()) for n, t in self.source]

        def send() -> None:
            Nccl.trainer_send_weights(iter(pairs), {"group": self.group, "packed": self.packed})
            torch.cuda.current_stream().synchronize()

        try:
            _session(self.client, {**announced(pairs), "packed": self.packed}, self.timeout,
                     lambda: vllm_ext.within(send, self.timeout, "NCCL send"))
        except vllm_ext.EngineTimeout as exc:
            vllm_ext.mark_unusable(getattr(self.client, "llm", self.client), str(exc))
            self.shutdown()  # its workers may wait in a broadcast: abort ours
            raise

    shutdown = UpdateGroup.leave_group  # a bounded abort; the workers': versions.shutdown_transfer
