"""Inside one device: the roofline the planner prices ops with, FlashAttention from tiles against
PyTorch's, FP8 emulated against torch._scaled_mm and trained with, fusion's byte counts, the MFU split."""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from labkit.core.model import GPTConfig
from labkit.device import fp8, fusion
from labkit.device.flash_attention import attention_memory, flash_attention, naive_attention
from labkit.device.roofline import Roof, block_ops, elementwise, matmul, optimizer_op
from labkit.launch import launch
from labkit.memory.architecture import ModelShape
from labkit.planning.hardware import hardware
from labkit.planning.mfu_breakdown import PARTS, breakdown, examples
from labkit.planning.step_model import Plan, predict
from labkit.train import TrainConfig, train

LLAMA7 = ModelShape.from_dims("llama", 4096, 32, 32, 32000, 4096)


def test_a_matmul_is_counted_and_bounded_by_the_roof_it_is_under():
    op = matmul("mm", 1024, 4096, 4096, value_bytes=2)
    assert op.flops == 2 * 1024 * 4096 * 4096 and op.bytes == 2 * (1024 * 4096 + 4096 * 4096 + 1024 * 4096)
    roof = Roof("toy", 100e12, 1e12)
    assert roof.ridge == 100 and roof.bound(op) == "compute" and roof.time(op) == op.flops / 100e12
    small = matmul("gemv", 1, 4096, 4096)
    assert roof.bound(small) == "memory" and roof.time(small) == small.bytes / 1e12
    assert roof.attainable(1.0) == 1e12 and roof.attainable(1e6) == 100e12
    assert elementwise("add", 2, 1, 1).intensity < 1


def test_block_ops_cover_each_projection_and_every_element_wise_op():
    names = [op.name for op in block_ops(LLAMA7, 1)]
    assert names == ["norm 1", "q", "k", "v", "attention", "o", "residual 1", "norm 2", "gate", "up", "SwiGLU",
                     "down", "residual 2"]
    gpt = ModelShape.from_dims("gpt", 768, 12, 12, 50257, 1024)
    unfused = [op.name for op in block_ops(gpt, 2, flash=False)]
    assert unfused[1:5] == ["qkv", "scores QK^T", "softmax", "probs @ V"] and "GELU" in unfused
    causal = next(o for o in block_ops(gpt, 2) if o.name == "attention")
    full = next(o for o in block_ops(gpt, 2, causal=False) if o.name == "attention")
    assert causal.flops * 2 == full.flops == 4 * 2 * 12 * 1024 ** 2 * 64
    # the block's matmul FLOPs are 2 per parameter per token (the 6N rule's forward third)
    mm = sum(o.flops for o in block_ops(LLAMA7, 1) if o.kind == "matmul")
    assert mm == 2 * 4096 * (4 * 4096 ** 2 + 3 * 4096 * LLAMA7.ffn)


def test_the_planner_prices_its_optimizer_step_with_the_roofline():
    hw = hardware("h100-80gb")
    plan = Plan(dp=8, micro_batch=1, global_batch=8, zero=0)
    params = LLAMA7.n_params
    assert predict(LLAMA7, plan, hw)["optimizer"] == hw.roof().time(optimizer_op(params))
    assert hw.roof(achieved=False).flops_per_s == 989e12 and hw.roof().flops_per_s == 989e12 * 0.8


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq, block", [(128, 32), (100, 32), (64, 64), (50, 16)])
def test_flash_attention_equals_sdpa_forward_and_backward(causal, seq, block):
    g = torch.Generator().manual_seed(seq + block)
    q, k, v = (torch.randn(2, 3, seq, 16, generator=g, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grad = torch.randn(ref.shape, generator=g)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    stats: dict = {}
    out = flash_attention(q, k, v, causal, block, stats)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert (out - ref).abs().max() < 1e-5  # fp32: the tiles sum in another order
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(got, want))
    n = math.ceil(seq / block)
    assert stats["tiles"] == (n * (n + 1) // 2 if causal else n * n)  # causal: future tiles skipped


def test_flash_attention_keeps_no_s_by_s_tensor_and_recomputes_the_scores():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    naive = attention_memory(naive_attention, q, k, v)
    flash = attention_memory(lambda a, b, c: flash_attention(a, b, c, True, 64), q, k, v)
    sdpa = attention_memory(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)
    assert flash["saved_bytes"] == sdpa["saved_bytes"] < naive["saved_bytes"] / 8
    assert naive["largest_tensor_bytes"] == 2 * 256 * 256 * 4 and flash["largest_tensor_bytes"] < 2 * 256 * 64 * 4 + 1
    ratios = []
    for fn in (lambda a, b, c: naive_attention(a, b, c, False), lambda a, b, c: flash_attention(a, b, c, False)):
        a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
        with FlopCounterMode(display=False) as fwd:
            out = fn(a, b, c)
        with FlopCounterMode(display=False) as bwd:
            out.sum().backward()
        ratios.append(bwd.get_total_flops() / fwd.get_total_flops())
    assert ratios == [2.0, 2.5]


def test_flash_attention_names_bad_inputs():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="share one shape"):
        flash_attention(q, torch.randn(1, 2, 9, 4), q)
    with pytest.raises(ValueError, match="block must be a positive int"):
        flash_attention(q, q, q, block=0)


def test_fp8_emulation_equals_torchs_fp8_gemm():
    """The same FP8 operands and scales: every product is exact in fp32 (two 4-bit mantissas), so the
    two GEMMs differ only by the order each CPU kernel sums in, a few ulps of the sum of |terms|
    (bit-equal on some CPUs, 6e-7 apart on others); a wrong scale or format is off by percents."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g) * 0.02
    xq, wq = fp8.fake_quantize(x), fp8.fake_quantize(w)
    emulated = xq @ wq.t()
    order = 256 * torch.finfo(torch.float32).eps * (xq.abs() @ wq.abs().t())  # summation-order bound
    assert ((fp8.scaled_mm(x, w) - emulated).abs() <= order).all()
    assert (emulated - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()



def _library_gemm(a: torch.Tensor, ta: tuple, b: torch.Tensor, tb: tuple, fmt_a: str, run: int) -> torch.Tensor:
    """``a @ b.T`` (both [rows, K]) through torch._scaled_mm: each operand quantised with its tile, the
    sum over K taken in runs of ``run`` (the whole of K, or DeepSeek-V3's 128: its kernels promote the
    sum every 128), each run one GEMM with a scale per row of ``a`` and per column of ``b.T``: a scale
    that changed within a run could not be applied after that run's GEMM."""
    (qa, sa), (qb, sb) = fp8.quantize(a, fmt_a, ta), fp8.quantize(b, "e4m3", tb)
    assert (ta[1] or a.shape[1]) == (tb[1] or b.shape[1]) == run, (ta, tb, run)
    out = 0
    for c in range(0, a.shape[1], run):
        col = slice(c, c + run)
        rows_a = sa[:, c // run].repeat_interleave(ta[0] or a.shape[0])[:a.shape[0]]
        rows_b = sb[:, c // run].repeat_interleave(tb[0] or b.shape[0])[:b.shape[0]]
        out = out + torch._scaled_mm(qa[:, col].contiguous(), qb[:, col].contiguous().t(),
                                     scale_a=rows_a[:, None].contiguous(), scale_b=rows_b[None, :].contiguous(),
                                     out_dtype=torch.float32)
    return out


@pytest.mark.parametrize("recipe", sorted(fp8.RECIPES))
def test_fp8_linears_three_gemms_equal_torchs_fp8_gemm(recipe):
    """Forward, input gradient and weight gradient of an FP8Linear, each held against torch._scaled_mm
    on the same operands: every scale of every GEMM is constant along what it sums (the weight
    gradient re-tiles the forward's FP8 activation along tokens). One scale per operand, or per row,
    is one GEMM over the whole sum; DeepSeek-V3's tiles are one GEMM per 128-long run, summed. On a
    CPU torch._scaled_mm multiplies in fp32 as the emulation does: what is held is which scale goes
    with which rows and columns."""
    r = fp8.RECIPES[recipe]
    run = {"tensor": None, "row": None, "block": 128}[recipe]  # None: the whole of what is summed
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((256, 384), (256, 384), (256, 256)))
    lin = fp8.to_fp8(torch.nn.Linear(384, 256, bias=False), recipe, skip=())
    lin.weight.data.copy_(w)
    xr = x.clone().requires_grad_()
    lin(xr).backward(g)
    t = lambda tile: tile[::-1]  # the same tiles on the transposed operand
    (fx, fw), (ig, iw), (wg, wx) = r["forward"], r["input_grad"], r["weight_grad"]
    xq = fp8.fake_quantize(x, "e4m3", fx)
    want = {"forward": _library_gemm(x, fx, w, fw, "e4m3", run or 384),
            "input_grad": _library_gemm(g, ig, w.t(), t(iw), r["grad_format"], run or 256),
            "weight_grad": _library_gemm(g.t(), t(wg), xq.t(), t(wx), r["grad_format"], run or 256)}
    got = {"forward": lin(x), "input_grad": xr.grad, "weight_grad": lin.weight.grad}
    for gemm in want:
        if recipe == "block":
            torch.testing.assert_close(got[gemm], want[gemm], rtol=1e-5, atol=1e-4, msg=gemm)
        else:
            assert torch.equal(got[gemm], want[gemm]), (recipe, gemm)



def test_fp8_gemm_speed_says_where_fp8_is_hardware(monkeypatch):
    speed = fp8.gemm_speed(64, "cpu", torch.float32, repeats=1)
    assert speed["n"] == 64 and speed["flops_per_s"] > 0 and speed["fp8_flops_per_s"] > 0
    assert speed["fp8_units"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, units in (((8, 0), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8.has_fp8_units("cuda") is units and fp8.has_fp8_units("cuda:1") is units
    assert not fp8.has_fp8_units("cpu")

def test_fp8_scales_per_tensor_row_and_tile():
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.01
    x[:, 7] *= 10_000  # an outlier channel the format's range cannot span with one scale
    q, scale = fp8.quantize(x, "e4m3", (1, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256, 4)
    assert fp8.quantize(x, "e5m2", (0, 0))[1].shape == (1, 1) and fp8.quantize(x, "e4m3", (1, 0))[1].shape == (256, 1)
    rest = torch.arange(512) != 7
    errs = [((fp8.fake_quantize(x, "e4m3", t) - x)[:, rest].norm() / x[:, rest].norm()).item()
            for t in ((0, 0), (1, 128))]
    assert errs[1] < 0.7 * errs[0]
    assert fp8.relative_error(torch.randn(64, 64), "e5m2") > fp8.relative_error(torch.randn(64, 64), "e4m3")
    w = torch.randn(192, 200)  # edge tiles smaller: 2 x 2 scales
    q, scale = fp8.quantize(w, "e4m3", (128, 128))
    assert q.shape == w.shape and scale.shape == (2, 2)
    assert torch.equal(fp8.dequantize(q, scale, (128, 128))[:128, :128], fp8.fake_quantize(w[:128, :128]))
    with pytest.raises(ValueError, match="fmt"):
        fp8.quantize(x, "e3m4")


def test_fp8_linears_keep_the_head_and_train_like_fp32():
    from labkit.core.model import build_model

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    model = fp8.to_fp8(build_model(cfg, 0), "block")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("head") == "Linear" and set(kinds.values()) == {"FP8Linear"}
    base = TrainConfig(steps=6, batch_size=8, lr=1e-3)
    ref = train(base, cfg)["loss"]
    for precision in ("fp8", "fp8-block"):
        loss = train(replace(base, precision=precision), cfg)["loss"]
        assert loss != ref and max(abs(a - b) for a, b in zip(loss, ref)) < 0.05, precision
    with pytest.raises(ValueError, match="precision='fp8' is not supported with strategy='tp'"):
        TrainConfig(strategy="tp", precision="fp8")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp8_under_ddp_and_fsdp_equals_one_process(strategy):
    """DeepSeek-V3's tiles scale each token's values on its own in the forward and the input gradient,
    and 128 tokens together in the weight gradient: each rank's 128 tokens are one process's tile
    (the first half of the batch, or the second), so splitting the batch over ranks changes no
    scale. The runs differ only where fp32's last bits (another reduction order, another
    thread count) tip a value over an fp8 rounding boundary (measured: 1e-5 on an AVX2 host, 5.3e-5
    on an AVX-512 one). Per-tensor scales are each rank's own amax over its half of the batch, so
    there every quantized value may move (measured: 1.5e-3), ten times more or worse."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    base = TrainConfig(steps=4, batch_size=8, lr=1e-3, count_comm="none")
    dev = {}
    for precision, tol in (("fp8-block", 3e-4), ("fp8", 1e-2)):
        ref = train(replace(base, precision=precision), cfg)["loss"]
        got = launch(train, replace(base, strategy=strategy, precision=precision), cfg, world_size=2,
                     quiet=True)[0]["loss"]
        dev[precision] = max(abs(a - b) for a, b in zip(got, ref))
        assert dev[precision] < tol, (precision, dev)
    assert dev["fp8"] > 2 * dev["fp8-block"], dev  # 28x and 150x measured on two hosts


def test_fsdp_gathers_in_fp8_send_a_quarter_less():
    bf16, f8 = (fp8.fsdp_bytes_per_step(1e9, 8, b) for b in (2, 1))
    assert bf16["total"] == pytest.approx(8e9 * 7 / 8) and f8["total"] == pytest.approx(6e9 * 7 / 8)


def test_eager_traffic_counts_each_kernels_inputs_and_outputs():
    x, b, r = torch.randn(64, 32), torch.randn(32), torch.randn(64, 32)
    t = fusion.eager_traffic(fusion.silu_residual_rmsnorm, x, b, r)
    assert t["kernels"] == 8 and t["bytes"] > 3 * fusion.floor_bytes((x, b, r), x)
    assert fusion.cuda_graph_seconds(fusion.silu_residual_rmsnorm, x, b, r) is None  # nothing to replay on CPU


def test_the_mfu_split_adds_up_to_the_step_and_its_mfu():
    hw = hardware("h100-80gb")
    for name, (shape, plan) in examples().items():
        b = breakdown(shape, plan, hw)
        assert sum(b[p] for p in PARTS) == pytest.approx(b["total"], rel=1e-12), name
        assert all(b[p] >= 0 for p in PARTS) and b["mfu"] == predict(shape, plan, hw)["mfu"]
    moe = ModelShape.from_dims("llama", 1024, 4, 8, 32000, 2048, experts=8, experts_per_token=2)
    with pytest.raises(ValueError, match="dense models"):
        breakdown(moe, Plan(), hw)
