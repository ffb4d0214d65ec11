"""Reproduce the capstone's illegal memory access on a GPU: a CUDA graph captured over the cuBLAS workspace of its
stream, then that workspace freed by torch's cudagraph trees (``clear_cublass_cache``) and the allocator's cache
emptied (``torch.cuda.graph`` does it before every recording). Prints one JSON line per case.

    python tools/repro_cublas_workspace.py torch          # pure torch: each case in a child process
    python tools/repro_cublas_workspace.py vllm           # an in-process vLLM engine with CUDA graphs
"""

from __future__ import annotations

import json
import subprocess
import sys


def torch_case(m: int, warm: bool, clear: bool) -> None:
    import torch

    k, n = 3584, 18944
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    if warm:  # the workspace of (handle, s) is allocated here, outside any graph's pool (as vLLM's warm-up does)
        with torch.cuda.stream(s):
            x @ w
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x @ w
    g.replay()
    torch.cuda.synchronize()
    ref = y.clone()
    if clear:
        torch._C._cuda_clearCublasWorkspaces()  # what cudagraph trees do before and after each recording
        torch.cuda.empty_cache()  # what torch.cuda.graph does before each capture
        junk = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")  # someone else takes the memory
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    print(json.dumps({"m": m, "warm": warm, "clear": clear, "replay_equal": bool(torch.equal(y, ref))}))


def vllm_case(clear: bool) -> None:
    import os
    import tempfile
    from pathlib import Path

    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and its worker) in this process
    from labsupport.bench.vllm_update import shape_config
    from vllm import LLM, SamplingParams

    d = Path(tempfile.mkdtemp())
    shape_config({"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "vocab_size": 151936}, dtype="bfloat16").save_pretrained(d)
    llm = LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
              max_num_seqs=512, gpu_memory_utilization=0.3, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=3, detokenize=False)

    def gen(batch: int) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": [11 + i, 22, 33, 44]} for i in range(batch)], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    before = {b: gen(b) for b in (512, 64, 8, 1)}
    if clear:
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        junk = torch.full((256 << 20,), 7, dtype=torch.uint8, device="cuda")
    after = {b: gen(b) for b in (512, 64, 8, 1)}
    print(json.dumps({"vllm": True, "clear": clear, "same": {b: before[b] == after[b] for b in before}}))


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if what == "torch-case":
        torch_case(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1")
        return
    if what == "vllm-case":
        vllm_case(sys.argv[2] == "1")
        return
    cases = ([("torch-case", str(m), w, c) for m in (1, 16, 64, 512) for w, c in (("1", "0"), ("1", "1"), ("0", "1"))]
             if what == "torch" else [("vllm-case", "0"), ("vllm-case", "1")])
    for case in cases:
        p = subprocess.run([sys.executable, __file__, *case], capture_output=True, text=True, timeout=600)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        err = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln][-1:]
        print(json.dumps({"case": case, "rc": p.returncode, "out": last, "error": err[0][:300] if err else None}),
              flush=True)


if __name__ == "__main__":
    main()
