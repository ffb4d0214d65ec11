"""Command line: ``python -m labsupport doctor | bench <what> | plan ... | rl ...``.

The command line lives here: ``doctor`` and ``plan`` are parsed in this file, benchmarks in
``labsupport.bench`` (one module per command) and the capstone in ``labsupport.rl``. The mechanisms
themselves parse no arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMANDS = {
    "doctor": "labsupport.__main__:doctor_cli",
    "plan": "labsupport.__main__:plan_cli",
    "rl": "labsupport.rl.cli:main",
}
BENCHES = {
    "links": "labsupport.bench.links:main",
    "sync": "labsupport.bench.sync:main",
    "ipc": "labsupport.bench.ipc:main",
    "memory": "labsupport.bench.memory:main",
    "cluster": "labsupport.bench.cluster:main",
    "vllm-update": "labsupport.bench.vllm_update:main",
    "lora": "labsupport.bench.lora:main",
    "reshard": "labsupport.bench.reshard:main",
    "fp8-update": "labsupport.bench.fp8_update:main",
    "peer": "labsupport.bench.peer:main",
    "peer2": "labsupport.bench.peer2:main",
    "faults": "labsupport.bench.faults:main",
    "soak": "labsupport.bench.soak:main",
}

USAGE = """usage: python -m labsupport <command> [options]

commands:
  doctor               what this machine has and which labs can take their GPU path
  bench links|sync|ipc|memory|cluster|vllm-update|reshard|lora|fp8-update|peer|peer2|faults|soak
                       benchmarks (print a table, write JSON under results/)
  plan ...             memory and transfer-time arithmetic (python -m labsupport plan -h)
  rl ...               the capstone's GRPO loop (python -m labsupport rl -h)
"""


def doctor_cli(argv: list[str]) -> int:
    """``python -m labsupport doctor [--json] [--save] [--no-ipc]``."""
    from labsupport.course import results
    from labsupport.course.hardware import doctor, format_doctor

    ap = argparse.ArgumentParser(prog="python -m labsupport doctor", description=doctor.__doc__)
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--save", action="store_true", help="also write results/doctor.<machine>.json")
    ap.add_argument("--no-ipc", action="store_true", help="skip the two-process CUDA IPC check")
    args = ap.parse_args(argv)
    rep = doctor(check_ipc=not args.no_ipc)
    print(json.dumps(rep, indent=1) if args.json else format_doctor(rep))
    if args.save:
        print("wrote", results.save_result("doctor", rep))
    return 0


def _plan_parser(models: list[str], layouts: list[str]) -> argparse.ArgumentParser:
    """The ``plan`` command's arguments: one sub-command per table."""
    p = argparse.ArgumentParser(prog="python -m labsupport plan",
                                description="Memory and transfer-time arithmetic for RLHF designs "
                                            "(GB = 1e9 bytes).")
    sub = p.add_subparsers(dest="cmd", required=True)
    z = sub.add_parser("zero", help="ZeRO stages 0-3 per GPU")
    z.add_argument("--gpus", type=int, default=64)
    k = sub.add_parser("kv", help="KV cache size")
    ac = sub.add_parser("act", help="activation estimate (Korthikanti et al. 2022)")
    lay = sub.add_parser("layout", help="per-GPU bytes of actor/critic/reference/reward")
    lay.add_argument("--layout", choices=layouts, default="colocated")
    lay.add_argument("--gpus", type=int, default=8, help="GPUs (colocated, hybrid)")
    lay.add_argument("--train", type=int, default=16, help="training GPUs (disaggregated)")
    lay.add_argument("--rollout", type=int, default=8, help="rollout GPUs (disaggregated)")
    lay.add_argument("--score", type=int, default=8, help="reference+reward GPUs (disaggregated)")
    lay.add_argument("--no-critic", action="store_true", help="GRPO-style: no critic model")
    lay.add_argument("--kv-gb", type=float, default=20.0, help="KV cache pool per rollout GPU (GB)")
    lay.add_argument("--act-gb", type=float, default=5.0, help="training activations per GPU (GB)")
    lay.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB (H100: 80, H200: "
                                                                "141)")
    t = sub.add_parser("transfer", help="weight-transfer time over link presets")
    t.add_argument("--gb", type=float, help="bytes to move in GB (default: the model in bf16)")
    t.add_argument("--seconds", type=float, help="also print the bandwidth needed to finish in "
                                                 "this time")
    t.add_argument("--links", type=int, default=1, help="parallel links (e.g. NICs)")
    for sp in (z, k, ac, lay, t):
        sp.add_argument("--model", default="70b", help=f"preset: {', '.join(models)}")
    for sp in (z, lay, t):
        sp.add_argument("--params", type=float, help="parameter count (overrides --model), e.g. "
                                                     "7.5e9")
    for sp in (k, ac):
        sp.add_argument("--seq", type=int, default=4096)
        sp.add_argument("--batch", type=int, default=1)
    return p


def plan_cli(argv: list[str]) -> int:
    """``python -m labsupport plan ...``: print the planner's tables."""
    from labsupport.course import planner as P
    from labsupport.experiments import memory_report as R

    a = _plan_parser(list(P.MODELS), list(P.LAYOUTS)).parse_args(argv)
    m = P.get_model(a.model)
    params = a.params if getattr(a, "params", None) is not None else m.params
    if a.cmd == "zero":
        print(R.zero_report(params, a.gpus))
    elif a.cmd == "kv":
        per_tok = P.model_kv_bytes(m, 1, 1)
        print(f"KV cache {m.name} ({m.layers} layers x {m.kv_heads} KV heads x {m.hd} head dim, "
              "bf16)")
        print(R.format_table([[f"{per_tok / 1e3:,.1f} KB", a.seq, a.batch,
                               R.fmt_gb(P.model_kv_bytes(m, a.seq, a.batch))]],
                             ["per token", "seq", "batch", "total GB"]))
    elif a.cmd == "act":
        rows = [[r, R.fmt_gb(P.model_activation_bytes(m, a.seq, a.batch, r))] for r in ("none",
                                                                                        "selective",
                                                                                        "full")]
        print(f"activations {m.name}: seq {a.seq}, micro-batch {a.batch} (Korthikanti et al. 2022)")
        print(R.format_table(rows, ["recompute", "GB/GPU"]))
    elif a.cmd == "layout":
        w = P.Workload(params, critic_params=0 if a.no_critic else None,
                       kv_bytes_per_gpu=a.kv_gb * P.GB, act_bytes_per_gpu=a.act_gb * P.GB)
        plan = P.plan_layout(a.layout, w, a.gpus, groups=dict(train=a.train, rollout=a.rollout,
                                                              score=a.score))
        print(R.layout_report(plan, a.gpu_gb * P.GB))
    elif a.cmd == "transfer":
        n = a.gb * P.GB if a.gb is not None else params * 2
        rows = [[l.name, f"{l.gb_per_s:g}", f"{P.transfer_seconds(n, l, a.links):.2f}",
                 "yes" if l.measured_here else "", l.source] for l in P.LINKS.values()]
        print(f"moving {R.fmt_gb(n)} GB over {a.links} link(s) of each kind (lower bound: bytes / "
              "bandwidth)")
        print(R.format_table(rows, ["link", "GB/s", "seconds", "measured here", "source"]))
        if a.seconds:
            need = P.required_gb_per_s(n, a.seconds) / a.links
            ok = [l.name for l in P.LINKS.values() if l.gb_per_s >= need]
            print(f"to finish in {a.seconds:g} s: {need:.1f} GB/s per link; fast enough: "
                  f"{', '.join(ok) or 'none'}")
    return 0


def _call(target: str, argv: list[str]) -> int:
    """Run a command; a missing package (``hardware.require``) ends it with its one line, not a
    traceback."""
    from labsupport.course.hardware import MissingDependency

    module, func = target.split(":")
    try:
        return int(getattr(importlib.import_module(module), func)(argv) or 0)
    except MissingDependency as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"bench needs one of: {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        return _call(BENCHES[rest[0]], rest[1:])
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return _call(COMMANDS[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
