"""The planner against published figures (ZeRO paper, vLLM paper) and hand-computed values."""
import pytest

from labsupport.course import planner as P

GB = 1e9


@pytest.mark.parametrize("params,n,expected", [
    # ZeRO (Rajbhandari et al. 2020) Figure 1: 7.5B params on 64 GPUs -> 120 / 31.4 / 16.6 / 1.88 GB
    (7.5e9, 64, [120.0, 31.40625, 16.640625, 1.875]),
    # Table 1 rows: 7.5B on 16 GPUs; 128B on 64; 1T on 1024 (paper prints 35.6, 21.6, 7.5 / 536, 284, 32 /
    # 4011.7, 2013.7, 15.6)
    (7.5e9, 16, [120.0, 35.625, 21.5625, 7.5]),
    (128e9, 64, [2048.0, 536.0, 284.0, 32.0]),
    (1e12, 1024, [16000.0, 4011.71875, 2013.671875, 15.625]),
])
def test_zero_stages_match_paper(params, n, expected):
    got = [z.total / GB for z in P.zero_table(params, n)]
    assert got == pytest.approx(expected, rel=1e-12)


def test_zero_figure1_rounded_as_printed():
    got = [z.total / GB for z in P.zero_table(7.5e9, 64)]
    assert [round(got[0]), round(got[1], 1), round(got[2], 1), round(got[3], 2)] == [120, 31.4, 16.6, 1.88]


def test_bytes_per_param_mixed_precision_adam_is_16():
    b = P.bytes_per_param()
    assert (b.weights, b.grads, b.optimizer, b.total) == (2, 2, 12, 16)
    # GPT-2 1.5B: >= 24 GB of model states vs 3 GB of fp16 weights (ZeRO sec. 3.1)
    assert 1.5e9 * b.total / GB == 24.0 and 1.5e9 * b.weights / GB == 3.0
    fp32 = P.bytes_per_param("fp32")  # fp32 weights need no separate master copy: 4 + 4 + 8
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4, 4, 8)
    assert P.bytes_per_param("bf16", optimizer="frozen").total == 2


def test_zero_rejects_bad_input():
    with pytest.raises(ValueError, match="stage"):
        P.zero_memory(1e9, 8, 4)
    with pytest.raises(ValueError, match="n_gpus"):
        P.zero_memory(1e9, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        P.bytes_per_param("fp12")


def test_kv_cache_hand_computed():
    # vLLM paper (Kwon et al. 2023): OPT-13B, 40 layers x 5120 hidden, fp16 -> 800 KB per token
    assert P.kv_cache_bytes(40, 40, 128, 1, 1, "fp16") == 2 * 5120 * 40 * 2 == 819_200
    # Llama-2-7B (MHA, 32 x 32 x 128): 0.5 MiB per token in bf16
    assert P.model_kv_bytes(P.get_model("7b"), 1, 1) == 2**19
    # 70B preset (80 layers, 8 KV heads x 128): 4096 tokens x 8 sequences in bf16 = exactly 10 GiB
    assert P.model_kv_bytes(P.get_model("70b"), 4096, 8) == 10 * 2**30
    assert P.kv_cache_bytes(2, 2, 64, 128, 16, "fp32") == 2 * 2 * 2 * 64 * 128 * 16 * 4
    with pytest.raises(ValueError):
        P.kv_cache_bytes(2, 2, 64, -1, 1)


def test_model_presets_parameter_counts():
    # published sizes: Llama-2-7B 6.74B, Llama-3.1-8B 8.03B, Llama-2-13B 13.0B, 70B 70.6B, 405B 405.9B
    expect = {"7b": 6.74, "8b": 8.03, "13b": 13.02, "70b": 70.55, "405b": 405.85}
    for name, billions in expect.items():
        assert P.get_model(name).params / 1e9 == pytest.approx(billions, abs=0.01), name
    with pytest.raises(ValueError, match="70b"):
        P.get_model("69b")


def test_activation_formula_hand_computed():
    # 1 layer, h=4, a=2, s=8, b=1: s*b*h = 32; (34 + 5*a*s/h) = 54
    assert P.activation_bytes(1, 4, 2, 8, 1, "none") == 32 * 54
    assert P.activation_bytes(1, 4, 2, 8, 1, "selective") == 32 * 34
    assert P.activation_bytes(1, 4, 2, 8, 1, "full") == 32 * 2
    assert P.activation_bytes(3, 4, 2, 8, 1, "selective", tensor_parallel=2) == 3 * 32 * 34 / 2
    with pytest.raises(ValueError, match="recompute"):
        P.activation_bytes(1, 4, 2, 8, 1, "some")


def test_transfer_times():
    assert P.required_gb_per_s(140e9, 10) == 14.0
    assert P.transfer_seconds(140e9, 14.0) == pytest.approx(10.0)
    # 70B in bf16 over one NDR 400 Gb/s NIC (50 GB/s): 2.8 s lower bound
    assert P.transfer_seconds(140e9, "ib-ndr-400") == pytest.approx(2.8)
    assert P.transfer_seconds(140e9, P.LINKS["ib-ndr-400"], n_links=8) == pytest.approx(0.35)
    assert P.LINKS["pcie5-pinned"].measured_here and not P.LINKS["nvlink4-nccl"].measured_here
    with pytest.raises(ValueError):
        P.transfer_seconds(1e9, "carrier-pigeon")


def test_layouts_70b_exercise():
    w = P.Workload(70e9, kv_bytes_per_gpu=20 * GB, act_bytes_per_gpu=5 * GB, rollout_tp=8)
    colo = P.plan_layout("colocated", w, 8)
    # actor + critic training states 2 x 16 x 70e9 / 8, reference + reward 2 x 2 x 70e9 / 8, rollout 2 x 70e9 / 8
    assert colo.peak == pytest.approx((2 * 140 + 2 * 17.5 + 17.5 + 20 + 5) * GB)
    assert not colo.fits(80 * GB)
    hyb = P.plan_layout("hybrid", w, 8)
    assert hyb.peak == pytest.approx((140 + 5) * GB) and hyb.groups[0].peak_phase == "train actor"
    assert hyb.groups[0].host_bytes_per_gpu == pytest.approx((140 + 140 + 17.5 + 17.5) * GB)
    dis = P.plan_layout("disaggregated", P.Workload(70e9, critic_params=0, kv_bytes_per_gpu=20 * GB,
                                                     act_bytes_per_gpu=5 * GB),
                        groups={"train": 16, "rollout": 8, "score": 8})
    assert dis.n_gpus == 32 and dis.peak == pytest.approx((70 + 5) * GB) and dis.fits(80 * GB)
    with pytest.raises(ValueError, match="missing"):
        P.plan_layout("disaggregated", w, groups={"train": 16})
    with pytest.raises(ValueError, match="layout"):
        P.plan_layout("scattered", w, 8)


def test_cli_prints_tables(capsys):
    """``python -m labsupport plan ...`` (parsed in labsupport/__main__.py) prints the planner's tables."""
    from labsupport.__main__ import main

    assert main(["plan", "zero", "--params", "7.5e9", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "120.0" in out and "31.41" in out and "16.64" in out and "1.88" in out
    main(["plan", "transfer", "--gb", "140", "--seconds", "10"])
    out = capsys.readouterr().out
    assert "14.0 GB/s" in out and "2.80" in out
    main(["plan", "kv", "--model", "70b", "--seq", "4096", "--batch", "8"])
    assert "10.74" in capsys.readouterr().out  # 10 GiB = 10.74 GB
    main(["plan", "layout", "--layout", "disaggregated", "--no-critic", "--params", "70e9"])
    assert "fits" in capsys.readouterr().out


def test_numbers_quoted_in_lab2_solutions():
    """labs/lab_02_memory_timeline.md quotes these in its solutions; keep the text true."""
    w = P.Workload(70e9, kv_bytes_per_gpu=20 * GB, act_bytes_per_gpu=5 * GB, rollout_tp=8)
    assert P.plan_layout("colocated", w, 8).peak / GB == pytest.approx(357.5)
    hyb = P.plan_layout("hybrid", w, 8)
    assert (hyb.peak / GB, hyb.groups[0].host_bytes_per_gpu / GB) == pytest.approx((145, 315))
    dis = P.plan_layout("disaggregated", w, groups={"train": 16, "rollout": 8, "score": 8})
    assert [g.peak / GB for g in dis.groups] == pytest.approx([145, 37.5, 35])
    dis48 = P.plan_layout("disaggregated", w, groups={"train": 32, "rollout": 8, "score": 8})
    assert dis48.n_gpus == 48 and dis48.groups[0].peak / GB == pytest.approx(75)
    assert (2 * 16 * 70e9 + 3 * 2 * 70e9) / 1e12 == pytest.approx(2.66)
    w64 = P.Workload(70e9, kv_bytes_per_gpu=40 * GB, act_bytes_per_gpu=5 * GB, rollout_tp=8)
    h64 = P.plan_layout("hybrid", w64, 64)
    assert h64.peak / GB == pytest.approx(57.5) and h64.groups[0].peak_phase == "generate"
    assert h64.groups[0].host_bytes_per_gpu / GB == pytest.approx(39.375)
    d64 = P.plan_layout("disaggregated", w64, groups={"train": 32, "rollout": 24, "score": 8})
    assert [g.peak / GB for g in d64.groups] == pytest.approx([75, 57.5, 35]) and d64.n_gpus == 64
    secs = {n: P.transfer_seconds(140e9, n) for n in ("pcie5-pageable", "pcie5-pinned", "nvlink4-nccl")}
    assert [round(secs[n], 2) for n in secs] == [18.18, 2.55, 0.38]


def test_colocated_fit_says_what_is_needed_and_which_utilization_fits():
    gib = 2**30
    ok = P.check_colocated_fit(0.3, 2 * gib, free_bytes=79 * gib, total_bytes=80 * gib)
    assert ok["fits"] and ok["need_bytes"] == int(0.3 * 80 * gib) + 2 * gib + gib
    fit = P.colocated_fit(0.3, 2 * gib, free_bytes=20 * gib, total_bytes=80 * gib)
    assert not fit["fits"] and fit["max_gpu_memory_utilization"] == 0.2  # (20 - 2 - 1) / 80 = 0.2125
    with pytest.raises(P.InsufficientMemory, match=r"need 27\.0 GiB free.*20\.0 GiB is free.*0\.20 or less"):
        P.check_colocated_fit(0.3, 2 * gib, free_bytes=20 * gib, total_bytes=80 * gib)
    with pytest.raises(P.InsufficientMemory, match="no gpu_memory_utilization fits"):
        P.check_colocated_fit(0.3, 2 * gib, free_bytes=3 * gib, total_bytes=80 * gib)
