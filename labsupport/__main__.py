"""Command line: ``python -m labsupport doctor | bench <what> | plan ... | rl ...``.

Benchmarks live in ``labsupport.bench`` (one module per command); this file only dispatches.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "doctor": "labsupport.hardware:doctor_main",
    "plan": "labsupport.planner:main",
    "rl": "labsupport.rl:main",
}
BENCHES = {
    "links": "labsupport.bench.links:main",
    "sync": "labsupport.bench.sync:main",
    "ipc": "labsupport.bench.ipc:main",
    "memory": "labsupport.bench.memory:main",
    "cluster": "labsupport.bench.cluster:main",
    "vllm-update": "labsupport.bench.vllm_update:main",
    "reshard": "labsupport.bench.reshard:main",
}

USAGE = """usage: python -m labsupport <command> [options]

commands:
  doctor               what this machine has and which labs can take their GPU path
  bench links|sync|ipc|memory|cluster|vllm-update|reshard
                       benchmarks (print a table, write JSON under results/)
  plan ...             memory and transfer-time arithmetic (python -m labsupport plan -h)
  rl ...               the capstone's GRPO loop (python -m labsupport rl -h)
"""


def _call(target: str, argv: list[str]) -> int:
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


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
