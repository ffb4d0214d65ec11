"""Memory and time arithmetic for RLHF system design: ZeRO stages, KV cache, activations, per-GPU
totals of co-located / hybrid / disaggregated layouts, whether a co-located engine fits beside its
trainer, transfer times.

Units: bytes in, bytes out, GB = 1e9 bytes (the ZeRO paper's unit). ``experiments.memory_report``
prints the tables that ``python -m labsupport plan {zero,kv,act,layout,transfer} ...`` shows."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 1e9

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def _preset(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}: expected one of {list(table)}")
    return table[name]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as "bf16"."""
    return _preset(DTYPE_BYTES, dtype, "dtype")


# ---------------------------------------------------------------- bytes per parameter / ZeRO
@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states split the way the ZeRO paper splits them: per parameter, or per GPU."""
    weights: float
    grads: float
    # the paper's K: fp32 master copy + Adam momentum + variance = 12 bytes per parameter
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def bytes_per_param(weights: str = "bf16", optimizer: str = "adam") -> ModelStates:
    """Training-state bytes per parameter: mixed-precision Adam is 2 + 2 + 12 = 16 (ZeRO,
    Rajbhandari et al. 2020, sec. 3.1); optimizer="frozen" (a reference or reward model) has no
    grads or optimizer state."""
    w = dtype_bytes(weights)
    if optimizer == "frozen":
        return ModelStates(w, 0, 0)
    if optimizer != "adam":
        raise ValueError(f"unknown optimizer {optimizer!r}: expected 'adam' or 'frozen'")
    master = 4 if w < 4 else 0  # a separate fp32 master copy only when the weights are not fp32
    return ModelStates(w, w, master + 4 * 2)  # + Adam's two fp32 moments


def zero_memory(params: float, n_gpus: int, stage: int) -> ModelStates:
    """Per-GPU model-state bytes (mixed-precision Adam) over n_gpus data-parallel GPUs for ZeRO
    stage 0 (plain data parallel), 1 (optimizer state sharded, P_os), 2 (+ gradients, P_os+g) or 3
    (+ parameters, P_os+g+p)."""
    if stage not in (0, 1, 2, 3) or n_gpus < 1:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 and n_gpus >= 1; found stage {stage}, "
                         f"n_gpus {n_gpus}")
    b, n = bytes_per_param(), n_gpus
    return ModelStates(weights=params * b.weights / (n if stage >= 3 else 1),
                       grads=params * b.grads / (n if stage >= 2 else 1),
                       optimizer=params * b.optimizer / (n if stage >= 1 else 1))


def zero_table(params: float, n_gpus: int) -> list[ModelStates]:
    """ZeRO stages 0 to 3 for one model size and GPU count (the rows of the paper's Figure 1)."""
    return [zero_memory(params, n_gpus, s) for s in range(4)]


# ---------------------------------------------------------------- model presets
@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer, enough for memory arithmetic."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    source: str = ""

    @property
    def hd(self) -> int:  # head dimension
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Parameter count: Llama/Qwen-style (SwiGLU MLP, RMSNorm, no biases), untied embeddings."""
        attn = self.hidden * self.heads * self.hd * 2 + self.hidden * self.kv_heads * self.hd * 2
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


# Shapes copied from the models' public config.json files on the Hugging Face Hub (``source``).
MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("7b", 32, 4096, 32, 32, 11008, 32000, "meta-llama/Llama-2-7b-hf (MHA)"),
    ModelSpec("8b", 32, 4096, 32, 8, 14336, 128256, "meta-llama/Llama-3.1-8B (GQA 8)"),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, "Qwen/Qwen2.5-7B (GQA 4)"),
    ModelSpec("13b", 40, 5120, 40, 40, 13824, 32000, "meta-llama/Llama-2-13b-hf (MHA)"),
    ModelSpec("70b", 80, 8192, 64, 8, 28672, 128256, "meta-llama/Llama-3.1-70B (GQA 8)"),
    ModelSpec("405b", 126, 16384, 128, 8, 53248, 128256, "meta-llama/Llama-3.1-405B (GQA 8)"),
]}


def get_model(name: str) -> ModelSpec:
    """A preset by name (see MODELS); raises a ValueError listing the presets otherwise."""
    return _preset(MODELS, name.lower(), "model preset")


# ---------------------------------------------------------------- KV cache and activations
def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, seq_len: int, batch: int,
                   dtype: str = "bf16") -> int:
    """Bytes of a KV cache: 2 (K and V) x layers x kv_heads x head_dim x tokens x bytes/element.
    E.g. OPT-13B (40 layers, 40 heads x 128) in fp16 needs 800 KB per token (vLLM paper)."""
    if min(layers, kv_heads, head_dim, seq_len, batch) < 0:
        raise ValueError(f"sizes must be >= 0, found {layers=}, {kv_heads=}, {head_dim=}, "
                         f"{seq_len=}, {batch=}")
    return 2 * layers * kv_heads * head_dim * seq_len * batch * dtype_bytes(dtype)


def model_kv_bytes(model: ModelSpec, seq_len: int, batch: int, dtype: str = "bf16") -> int:
    """kv_cache_bytes for a ModelSpec preset."""
    return kv_cache_bytes(model.layers, model.kv_heads, model.hd, seq_len, batch, dtype)


def activation_bytes(layers: int, hidden: int, heads: int, seq_len: int, batch: int,
                     recompute: str = "none", tensor_parallel: int = 1) -> float:
    """Activation bytes saved for backward in a training step (16-bit activations, GPT-style 4h
    MLP): per layer s*b*h*(34 + 5*a*s/h), divided by t under tensor+sequence parallelism
    (Korthikanti et al. 2022, eq. 1-2, sec. 5); "selective" recompute (or flash attention: no a*s*s
    scores) leaves 34*s*b*h/t, "full" only the layer input, 2*s*b*h. Logits, loss and pipeline
    micro-batches in flight are not counted."""
    s, b, h, a, t = seq_len, batch, hidden, heads, tensor_parallel
    per_layer = {"none": s * b * h * (34 + 5 * a * s / h) / t, "selective": 34 * s * b * h / t,
                 "full": 2 * s * b * h}
    if recompute not in per_layer:
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', found {recompute!r}")
    return layers * per_layer[recompute]


def model_activation_bytes(model: ModelSpec, seq_len: int, batch: int,
                           recompute: str = "full") -> float:
    """activation_bytes for a ModelSpec preset."""
    return activation_bytes(model.layers, model.hidden, model.heads, seq_len, batch, recompute)


# ---------------------------------------------------------------- RLHF layouts
@dataclass
class Workload:
    """What one RLHF setup runs: sizes of the four models, rollout and training shapes."""
    actor_params: float
    critic_params: float | None = None  # None -> same as actor (PPO); 0 -> no critic (GRPO)
    reference_params: float | None = None  # None -> same as actor; 0 -> no KL term
    reward_params: float | None = None  # None -> same as actor; 0 -> rule-based reward
    kv_bytes_per_gpu: float = 0.0  # KV cache pool of the rollout engine on each of its GPUs
    act_bytes_per_gpu: float = 0.0  # activations of one training micro-batch on each GPU
    rollout_tp: int = 8  # tensor-parallel size of the rollout engine (its weights split tp ways)
    frozen_dtype: str = "bf16"  # rollout and frozen models' weights

    def size(self, role: str) -> float:
        v = getattr(self, f"{role}_params")
        return self.actor_params if v is None else v

    def train(self, role: str, n: int) -> float:
        """Per-GPU bytes of a trained model's states, ZeRO-3-sharded over n GPUs."""
        return zero_memory(self.size(role), n, 3).total

    def frozen(self, role: str, n: int) -> float:
        """Per-GPU bytes of a frozen model's weights, split over n GPUs."""
        return self.size(role) * dtype_bytes(self.frozen_dtype) / n


@dataclass
class GroupPlan:
    """One group of identical GPUs and the bytes on each, by component, for each phase."""
    name: str
    n_gpus: int
    phases: dict[str, dict[str, float]]  # phase -> component -> bytes per GPU
    host_bytes_per_gpu: float = 0.0  # states parked in host memory (offloaded) per GPU

    @property
    def peak(self) -> float:
        return max(sum(c.values()) for c in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))


@dataclass
class LayoutPlan:
    """A layout's groups of GPUs (see plan_layout)."""
    layout: str
    groups: list[GroupPlan] = field(default_factory=list)

    @property
    def n_gpus(self) -> int:
        return sum(g.n_gpus for g in self.groups)

    @property
    def peak(self) -> float:
        return max(g.peak for g in self.groups)

    def fits(self, gpu_bytes: float) -> bool:
        return self.peak <= gpu_bytes


LAYOUTS = ("colocated", "hybrid", "disaggregated")


def plan_layout(layout: str, w: Workload, n_gpus: int | None = None, *,
                groups: dict[str, int] | None = None) -> LayoutPlan:
    """Per-GPU bytes of the actor, critic, reference and reward models for one layout. colocated:
    all four plus the rollout weights and KV cache resident on the same n_gpus (sharded). hybrid:
    the same n_gpus, only the current phase's states on the GPU, the rest in host memory (verl's
    hybrid engine). disaggregated: groups {"train": n, "rollout": n, "score": n}, models apart."""
    plan = LayoutPlan(layout)
    generate = {"rollout weights": w.frozen("actor", w.rollout_tp), "kv cache": w.kv_bytes_per_gpu}
    if layout in ("colocated", "hybrid"):
        if not n_gpus:
            raise ValueError(f"layout {layout!r} needs n_gpus")
        train = {r: w.train(r, n_gpus) for r in ("actor", "critic")}
        score = {"reference": w.frozen("reference", n_gpus), "reward": w.frozen("reward", n_gpus)}
        if layout == "colocated":
            plan.groups.append(GroupPlan("all", n_gpus, {"all phases": {
                "actor (train)": train["actor"], "critic (train)": train["critic"], **score,
                **generate, "activations": w.act_bytes_per_gpu}}))
        else:
            phases = {"generate": generate,
                      "score": {**score, "critic weights": w.frozen("critic", n_gpus)}}
            for r in ("actor", "critic") if w.size("critic") else ("actor",):
                phases[f"train {r}"] = {f"{r} (train)": train[r],
                                        "activations": w.act_bytes_per_gpu}
            parked = train["actor"] + train["critic"] + score["reference"] + score["reward"]
            plan.groups.append(GroupPlan("all", n_gpus, phases, host_bytes_per_gpu=parked))
    elif layout == "disaggregated":
        g = groups or {}
        missing = [k for k in ("train", "rollout", "score") if k not in g]
        if missing:
            raise ValueError("disaggregated needs GPU counts for groups train, rollout, score; "
                             f"missing {missing}")
        plan.groups.append(GroupPlan("train", g["train"], {"train": {
            "actor (train)": w.train("actor", g["train"]),
            "critic (train)": w.train("critic", g["train"]), "activations": w.act_bytes_per_gpu}}))
        plan.groups.append(GroupPlan("rollout", g["rollout"], {"generate": generate}))
        if g["score"]:
            plan.groups.append(GroupPlan("score", g["score"], {"score": {
                "reference": w.frozen("reference", g["score"]),
                "reward": w.frozen("reward", g["score"])}}))
    else:
        raise ValueError(f"unknown layout {layout!r}: expected one of {LAYOUTS}")
    return plan


# ---------------------------------------------------------------- one GPU, now: does it fit?
class InsufficientMemory(RuntimeError):
    """Raised before a run starts if it does not fit in the GPU memory free now; says what to do."""


def colocated_fit(gpu_memory_utilization: float, trainer_bytes: int, free_bytes: int,
                  total_bytes: int, *, headroom_bytes: int = 1 << 30) -> dict:
    """Does an engine of ``gpu_memory_utilization * total_bytes`` fit beside the trainer's state to
    come and ``headroom_bytes`` (activations, CUDA context, IPC bucket)? Bytes needed and free, and
    the largest utilization (steps of 0.05) that fits: vLLM won't start with less free than that."""
    engine = int(gpu_memory_utilization * total_bytes)
    need = engine + trainer_bytes + headroom_bytes
    room = free_bytes - trainer_bytes - headroom_bytes
    return {"fits": need <= free_bytes, "need_bytes": need, "engine_bytes": engine,
            "trainer_bytes": trainer_bytes, "headroom_bytes": headroom_bytes,
            "free_bytes": free_bytes, "total_bytes": total_bytes,
            "max_gpu_memory_utilization": math.floor(max(room, 0) / total_bytes * 20) / 20}


def check_colocated_fit(gpu_memory_utilization: float, trainer_bytes: int, *,
                        free_bytes: int | None = None, total_bytes: int | None = None,
                        headroom_bytes: int = 1 << 30) -> dict:
    """``colocated_fit`` on this GPU (``torch.cuda.mem_get_info`` unless given), or
    ``InsufficientMemory`` saying what is needed and what to change, before the engine starts."""
    if free_bytes is None or total_bytes is None:
        import torch  # (the rest of the planner is arithmetic on numbers)
        free_bytes, total_bytes = torch.cuda.mem_get_info()
    fit = colocated_fit(gpu_memory_utilization, trainer_bytes, free_bytes, total_bytes,
                        headroom_bytes=headroom_bytes)
    if fit["fits"]:
        return fit
    gib = lambda v: f"{v / 2**30:.1f} GiB"  # noqa: E731
    lower = (f"lower gpu_memory_utilization to {fit['max_gpu_memory_utilization']:.2f} or less"
             if fit["max_gpu_memory_utilization"] >= 0.05 else "no gpu_memory_utilization fits")
    raise InsufficientMemory(
        f"the co-located engine and trainer need {gib(fit['need_bytes'])} free on this GPU: "
        f"{gib(fit['engine_bytes'])} for the engine "
        f"(gpu_memory_utilization={gpu_memory_utilization} of {gib(total_bytes)}), "
        f"{gib(trainer_bytes)} for the trainer's state and {gib(headroom_bytes)} of headroom; "
        f"{gib(free_bytes)} is free. Stop other processes on the GPU (see nvidia-smi; a previous "
        f"kernel of this notebook may still hold it), or {lower}.")


# ---------------------------------------------------------------- links and transfer time
@dataclass(frozen=True)
class Link:
    """A link's usable bandwidth in GB/s per direction, with where the number comes from."""
    name: str
    gb_per_s: float
    source: str
    measured_here: bool = False  # measured for this course (4xH200 reference machine)


# Sources: /work/shared/reference anchors, sec. 3 ("Physical limits"); see book/references.bib.
LINKS: dict[str, Link] = {l.name: l for l in [
    Link("nvlink4-spec", 450, "H100/H200 SXM spec: 18 links x 50 GB/s = 900 GB/s bidirectional"),
    Link("nvlink4-nccl", 370,
         "NCCL over NVLink4, effective (~20% protocol overhead), NVIDIA/nccl-tests #212"),
    Link("nvlink4-h200-broadcast", 363,
         "torch.distributed broadcast busbw >= 1 GiB, 4xH200 NV18, NCCL 2.28.9", True),
    Link("pcie5-spec", 64, "PCIe Gen5 x16: 128 GB/s bidirectional, ~64 GB/s per direction"),
    Link("pcie5-pinned", 55, "pinned host<->device copy, H200 PCIe Gen5 (55.2 GB/s each way, "
         "results/links.4xH200.json)", True),
    Link("pcie5-pageable", 7.7,
         "pageable host->device copy, H200 PCIe Gen5 (results/links.4xH200.json)", True),
    Link("ib-ndr-400", 50, "InfiniBand NDR 400 Gb/s NIC line rate, per direction"),
    Link("ib-ndr-400-nccl", 47,
         "NCCL over one NDR NIC, '46-48 GB/s per NIC', NVIDIA/nccl-tests #290"),
    Link("ib-ndr-400-x8", 400, "8 NDR NICs per node (line rate), e.g. an 8-GPU H100 node"),
    Link("hbm-h200-copy", 2100, "device-to-device copy (bytes copied), H200", measured_here=True),
]}


def get_link(name: str) -> Link:
    """A link preset by name (see LINKS); raises a ValueError listing the presets otherwise."""
    return _preset(LINKS, name, "link")


def transfer_seconds(n_bytes: float, link: Link | str | float, n_links: int = 1) -> float:
    """Lower-bound seconds to move n_bytes over n_links parallel links (preset, name or GB/s)."""
    bw = link if isinstance(link, (int, float)) else (get_link(link) if isinstance(link, str)
                                                      else link).gb_per_s
    if bw <= 0 or n_links < 1:
        raise ValueError(f"bandwidth and n_links must be positive, found {bw} GB/s x {n_links}")
    return n_bytes / (bw * GB * n_links)


def required_gb_per_s(n_bytes: float, seconds: float) -> float:
    """Bandwidth (GB/s) needed to move n_bytes in the given time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, found {seconds}")
    return n_bytes / seconds / GB
