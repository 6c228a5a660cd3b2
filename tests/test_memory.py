"""The calculator against the published tables and against measurement. (FSDP on eight fake ranks
at a 7B shape against the calculator is the memory lab's, held in tests/test_labs.py.)"""
import pytest
import torch

from labkit import memory as mem
from labkit.memory.probe import activation_bytes_per_layer_measured, model_states_after_one_step, saved_activation_bytes
from labkit.core.model import GPT, GPTConfig, build_model


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, K = 12."""
    gb = [mem.zero_model_state_bytes(7_500_000_000, 64, s) / mem.GB for s in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]


def test_zero_formulas_and_breakdown_agree():
    psi, n = 1_000_003, 7
    assert mem.zero_model_state_bytes(psi, n, 0) == 16 * psi
    assert mem.zero_model_state_bytes(psi, 1, 3) == 16 * psi  # one rank: sharding changes nothing
    for s in range(4):
        total = mem.model_state_breakdown(psi, n, s, "mixed").total
        assert abs(total - mem.zero_model_state_bytes(psi, n, s)) <= 3  # per-part ceilings
    assert mem.zero_model_state_bytes(psi, n, 1, k=8) < mem.zero_model_state_bytes(psi, n, 1)


def test_breakdown_precisions_and_accumulation_buffer():
    b = mem.model_state_breakdown(100, precision="fp32")
    assert (b.params, b.grads, b.optimizer, b.total) == (400, 400, 800, 1600)
    assert mem.model_state_breakdown(100, precision="bf16").total == 800
    acc = mem.model_state_breakdown(100, 4, 2, "mixed", fp32_grad_accum=True)
    assert acc.grad_accum == 100 and acc.params == 200 and acc.grads == 50


def test_korthikanti_activation_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert mem.activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert mem.activation_bytes_per_layer(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), abs=1)
    assert mem.activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), abs=1)
    assert mem.activation_bytes_per_layer(s, b, h, a, recompute="selective") == 34 * sbh
    assert mem.activation_bytes_per_layer(s, b, h, a, tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t), abs=1)
    assert mem.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    # full recompute keeps ~2% of a GPT-3 layer's activations: "saves ~98%"
    ratio = mem.activation_bytes_per_layer(s, b, h, a, recompute="full") / mem.activation_bytes_per_layer(s, b, h, a)
    assert 0.01 < ratio < 0.03


def test_model_states_measured_within_one_percent():
    for cfg in (GPTConfig(), GPTConfig(n_layer=3, n_embd=96, n_head=4)):
        n = GPT.count_params(cfg)
        for precision in ("fp32", "bf16"):
            got = model_states_after_one_step(cfg, precision)
            want = mem.model_state_breakdown(n, precision=precision)
            assert got.params == want.params and got.grads == want.grads
            assert abs(got.total / want.total - 1) < 0.01


@pytest.mark.parametrize("cfg, b", [(GPTConfig(), 4), (GPTConfig(n_embd=96, n_head=3, block_size=48), 3)])
def test_saved_activations_per_layer_match_the_formula(cfg, b):
    """fp32: exact but for LayerNorm's mean/rstd (16sb bytes, < 1%); bf16 autocast: exact."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    f32 = mem.activation_bytes_per_layer(s, b, h, a, dtype_bytes=4, dropout=False, flash_attention=True)
    got32 = activation_bytes_per_layer_measured(cfg, b)
    assert got32 - f32 == 16 * s * b
    assert abs(got32 / f32 - 1) < 0.01
    b16 = (mem.activation_bytes_per_layer(s, b, h, a, dtype_bytes=2, dropout=False, flash_attention=True)
           + mem.autocast_extra_bytes_per_layer(s, b, h))
    assert activation_bytes_per_layer_measured(cfg, b, torch.bfloat16) == b16


def test_saved_activations_free_after_backward_and_exclude_parameters():
    model = build_model(GPTConfig())
    x = torch.randint(0, 256, (2, 64))
    saved = saved_activation_bytes(model, x, x)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < saved["total"] < 10 * param_bytes
    assert "addmm" in saved and "native_layer_norm" in saved


def test_whole_model_estimate_says_whether_it_fits():
    e = mem.estimate_memory("llama2-70b", world_size=8, stage=3, device_memory_gb=80)
    assert not e.fits and e.margin < 0 and e.total == e.device_bytes - e.margin
    off = mem.estimate_memory("llama2-70b", world_size=8, stage=3, recompute="full",
                              offload_optimizer=True, device_memory_gb=80)
    assert off.fits and off.optimizer == 0 and off.host_bytes == e.optimizer
    small = mem.estimate_memory("gpt2-124m", micro_batch=8, device_memory_gb=80)
    assert small.fits and small.to_dict()["fits"]


@pytest.mark.parametrize("call, match", [
    (lambda: mem.zero_model_state_bytes(0, 8, 1), "n_params must be a positive integer"),
    (lambda: mem.zero_model_state_bytes(1.5, 8, 1), "n_params must be a positive integer"),
    (lambda: mem.zero_model_state_bytes(10, 0, 1), "world_size must be a positive integer"),
    (lambda: mem.zero_model_state_bytes(10, 8, 4), r"stage=4 is unknown; valid ZeRO stages: \[0, 1, 2, 3\]"),
    (lambda: mem.model_state_breakdown(10, precision="fp8"), "precision='fp8' is unknown"),
    (lambda: mem.activation_bytes_per_layer(128, 1, 64, 4, recompute="some"), r"recompute='some' is unknown; valid modes: \['none', 'selective', 'full', 'op'\]"),
    (lambda: mem.activation_bytes_per_layer(-1, 1, 64, 4), "seq_len must be a positive integer"),
    (lambda: mem.estimate_memory("gpt-5"), "model='gpt-5' is unknown"),
    (lambda: mem.estimate_memory("gpt2-124m", world_size=6, tp=4), r"tp=4 x pp=1 x cp=1 \(and x ep=1\) must divide world_size=6"),
    (lambda: mem.estimate_memory("gpt2-124m", world_size=64, pp=16), "pp=16 stages need at least 16 layers"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_prints_the_breakdown(capsys):
    from labkit.planning.memory_cli import main

    assert main(["--model", "llama2-70b", "--devices", "8", "--tokens", "2e12"]) == 0
    out = capsys.readouterr().out
    assert "68.98 B parameters" in out and "recommended:" in out and "GPU-hours" in out
    assert out.count(" no\n") == 4  # no ZeRO stage alone fits 70B on 8 x 80 GB


def test_model_shapes_from_configs_and_parameter_counts():
    cfg = GPTConfig(n_layer=3, n_embd=96, n_head=4)
    assert mem.model_shape(cfg).n_params == GPT.count_params(cfg)
    gpt3 = mem.model_shape(175e9)  # GPT-3's proportions: 96 layers of width 12288
    assert (gpt3.n_layer, gpt3.hidden, gpt3.heads) == (96, 12288, 96)
    with pytest.raises(ValueError, match="a GPTConfig, a ModelShape or a parameter count"):
        mem.model_shape("gpt-5")


def test_pipeline_stages_divide_model_states_but_not_first_stage_activations():
    flat = mem.estimate_memory("gpt3-175b", world_size=64, stage=1, tp=8, recompute="full")
    piped = mem.estimate_memory("gpt3-175b", world_size=64, stage=1, tp=8, pp=4, recompute="full")
    assert piped.params == pytest.approx(flat.params / 4, rel=1e-6)
    assert piped.activations == flat.activations  # 1F1B: p micro-batches in flight on stage 0


def test_context_and_expert_parallelism_divide_what_they_split():
    """Context parallelism divides every activation term by cp (each rank holds seq_len/cp tokens);
    expert parallelism divides the experts' weights, gradients and optimizer states by ep."""
    from labkit.memory.architecture import expert_params

    one, four = (mem.estimate_memory("llama2-7b", 1, 8, 3, seq_len=131072, cp=c) for c in (1, 4))
    assert four.activations == pytest.approx(one.activations / 4, rel=1e-6) and four.head == pytest.approx(one.head / 4, rel=1e-6)
    assert (four.params, four.grads, four.optimizer) == (one.params, one.grads, one.optimizer)
    shape = mem.model_shape("mixtral-8x7b")
    assert (shape.n_params, shape.active_params) == (46_702_792_704, 12_879_925_248)  # Mistral AI's 46.7B / 12.9B
    dense = shape.n_params - expert_params(shape)
    for ep in (1, 2, 8):
        e = mem.estimate_memory(shape, 1, 8, 0, "mixed", ep=ep)
        held = dense + (expert_params(shape) / ep if ep > 1 else expert_params(shape))
        assert e.params == pytest.approx(2 * held, rel=1e-9) and e.optimizer == pytest.approx(12 * held, rel=1e-9)
    with pytest.raises(ValueError, match="ep=3 must divide the model's 8 experts"):
        mem.estimate_memory(shape, 1, 6, 0, ep=3)
    with pytest.raises(ValueError, match="ep=2 must divide the model's 1 experts"):
        mem.estimate_memory("llama2-7b", 1, 8, 0, ep=2)


def test_the_chooser_reaches_for_context_parallelism_on_long_sequences():
    from labkit.planning.choose import choose_strategy

    r = choose_strategy("llama2-7b", 8, 80, seq_len=131072)
    assert not r.rule_fits and r.chosen is not None  # FSDP alone does not fit 128k tokens a device
    assert all(x.plan.cp > 1 or x.plan.tp > 1 or x.plan.recompute != "none" for x in r.ranked)
    cp = [x for x in r.ranked if x.plan.cp > 1]
    assert cp and all(x.prediction["context_parallel"] >= 0 for x in cp)
    moe = choose_strategy("mixtral-8x7b", 64, 80, device="h100-80gb")
    ep = [x for x in moe.ranked if x.plan.ep > 1]
    assert ep and all(x.prediction["expert_parallel"] > 0 for x in ep)


def test_selective_under_flash_attention_keeps_what_labkit_s_policy_keeps():
    """labkit's selective policy keeps the block's input, every matmul's output and attention's
    output and log-sum-exp: 11 h values a token for GPT's block (no dropout), measured."""
    from labkit.core.model import GPTConfig
    from labkit.memory import activation_bytes_per_layer

    for s, h, a in ((64, 64, 4), (128, 128, 8)):
        cfg = GPTConfig(n_layer=2, n_embd=h, n_head=a, block_size=s, dropout=0.0)
        measured = activation_bytes_per_layer_measured(cfg, 2, checkpointing="selective")
        formula = activation_bytes_per_layer(s, 2, h, a, recompute="selective", dtype_bytes=4, dropout=False,
                                             flash_attention=True)
        assert measured == formula == 4 * 11 * s * 2 * h + 4 * a * s * 2
    # a SwiGLU block keeps 5h + 2kv + 2f; fused kernels keep 3 of the 4 ffn-wide tensors PyTorch's ops keep
    s, h, kv, f = 4096, 8192, 1024, 28672
    kw = dict(dropout=False, flash_attention=True, kv_dim=kv, ffn=f, swiglu=True)
    sel = activation_bytes_per_layer(s, 1, h, 64, recompute="selective", **kw) - 4 * 64 * s
    assert sel == 2 * s * (5 * h + 2 * kv + 2 * f)
    eager, fused = (activation_bytes_per_layer(s, 1, h, 64, fused=x, **kw) for x in (False, True))
    assert eager - fused == 2 * s * f


def test_a_swiglu_gqa_block_keeps_40_5_sbh_where_gpt_keeps_34():
    from labkit.memory import MODELS, activation_bytes_per_layer, estimate_memory

    s, b, h = 4096, 1, 8192
    gpt = activation_bytes_per_layer(s, b, h, 64, dropout=True, flash_attention=True) - 4 * 64 * s * b
    assert gpt == 34 * s * b * h
    shape = MODELS["llama2-70b"]
    est = estimate_memory(shape, 1, 1, 0, "mixed")
    lse = 4 * shape.heads * s * b  # FlashAttention's fp32 log-sum-exp
    assert est.parts["activation_bytes_per_layer"] - lse == 40.5 * s * b * h  # no dropout, 8 K/V heads, 4 ffn tensors


def test_context_parallel_scores_fall_as_one_over_c_not_its_square():
    """Without fused attention each CP rank keeps its s/C queries' scores against all s keys."""
    shape = mem.MODELS["llama2-7b"]
    common = dict(world_size=4, stage=3, flash_attention=False, dropout=False, seq_len=8192)
    one, two = (mem.estimate_memory(shape, cp=c, **common) for c in (1, 2))
    scores = 2 * shape.heads * 8192 * 8192  # 16-bit softmax output, no dropout: most of the layer here
    assert scores > one.parts["activation_bytes_per_layer"] / 2
    # every term halves, the scores too (as (s/2)^2 they would fall to a quarter)
    assert two.parts["activation_bytes_per_layer"] == one.parts["activation_bytes_per_layer"] // 2
