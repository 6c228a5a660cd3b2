"""Every lab's named parameter sets: ``cpu`` (a 2-core laptop), ``ci`` (the regression runs and the
book) and ``gpu`` (one GPU per rank, a node's worth). :mod:`labkit.labs.parameters` turns a profile into
a lab's parameters (a ``gpu`` profile fitted to the GPUs there are).

The ``gpu`` profiles train the GPT at GPT-2 small's shape (12 layers, 12 heads, 768 wide, context
1024): with the byte vocabulary of 256 that is 85.9 M parameters, not GPT-2's 124 M, whose 50,257-token
vocabulary adds 38 M in the embedding. Values a GPU count decides: ``"all"`` (every GPU),
``"8 per rank"`` (a global batch growing with the ranks), ``"2..world_size"`` and ``"1..world_size"``
(a sweep of rank counts).
"""
from __future__ import annotations

from labkit.labs.profiles_failures import FAILURES_AT_SCALE

# How the labs that train compare strategies: fp32 on CPU (held to one process within fp32's
# tolerances), and as GPU users train on GPUs: bf16 autocast over fp32 master weights, TF32 matmuls.
FP32 = dict(precision="fp32", tf32=False)
BF16_TF32 = dict(precision="bf16", tf32=True)

# One entry per lab; "cpu" must equal the defaults a reader sees in the lab's parameters cell.
PROFILES: dict[str, dict[str, dict]] = {
    # lr 1e-3: at 3e-3 the tiny lab models train chaotically (loss spikes), and after a spike even one
    # process accumulating microbatches departs from its own unaccumulated run (pipeline_parallel lab).
    "tensor_parallel": {
        "cpu": dict(**FP32, device="cpu", world_size=2, steps=30, batch_size=16, lr=1e-3, seed=0, n_layer=2, n_head=4,
                    n_embd=64, block_size=64, comm_batch_sizes=[4, 8, 16, 32], degrees=[1, 2, 4], sweep_steps=5,
                    steps_2d=10, bw_model="llama2-70b", bw_tp=8, bw_micro_batch=1, bw_device="h100-80gb"),
        "ci": dict(**FP32, device="cpu", world_size=2, steps=20, batch_size=8, lr=1e-3, seed=0, n_layer=2, n_head=4,
                   n_embd=64, block_size=32, comm_batch_sizes=[4, 8, 16], degrees=[1, 2, 4], sweep_steps=3,
                   steps_2d=4, bw_model="llama2-70b", bw_tp=8, bw_micro_batch=1, bw_device="h100-80gb"),
        # GPT-2 small's shape at context 1024 on up to 4 GPUs: TP 1/2/4 and a 2 x 2 FSDP x TP mesh.
        "gpu": dict(**BF16_TF32, device="cuda", world_size=4, steps=100, batch_size=8, lr=6e-4, seed=0, n_layer=12, n_head=12,
                    n_embd=768, block_size=1024, comm_batch_sizes=[2, 4, 8], degrees=[1, 2, 4], sweep_steps=10,
                    steps_2d=50, bw_model="llama2-70b", bw_tp=8, bw_micro_batch=1, bw_device="h100-80gb"),
    },
    "pipeline_parallel": {
        "cpu": dict(**FP32, device="cpu", world_size=2, steps=30, batch_size=16, lr=1e-3, seed=0, n_layer=4, n_head=2,
                    n_embd=64, block_size=64, microbatches=4, t_n_layer=4, t_n_embd=128, t_n_head=4, t_block_size=64,
                    mb_rows=2, bubble_ms=[1, 2, 4, 8, 16], bubble_steps=6, mem_pp=4, mem_microbatches=8,
                    plan_model="gpt3-175b", plan_devices=1024, plan_global_batch=1536, plan_device_gb=80.0),
        "ci": dict(**FP32, device="cpu", world_size=2, steps=20, batch_size=8, lr=1e-3, seed=0, n_layer=4, n_head=2,
                   n_embd=64, block_size=32, microbatches=4, t_n_layer=4, t_n_embd=128, t_n_head=4, t_block_size=64,
                   mb_rows=2, bubble_ms=[1, 4, 8], bubble_steps=3, mem_pp=4, mem_microbatches=8,
                   plan_model="gpt3-175b", plan_devices=1024, plan_global_batch=1536, plan_device_gb=80.0),
        # GPT-2 small's shape at context 1024, one stage per GPU on up to 4 GPUs.
        "gpu": dict(**BF16_TF32, device="cuda", world_size=4, steps=100, batch_size=32, lr=6e-4, seed=0, n_layer=12, n_head=12,
                    n_embd=768, block_size=1024, microbatches=8, t_n_layer=12, t_n_embd=768, t_n_head=12,
                    t_block_size=1024, mb_rows=2, bubble_ms=[1, 2, 4, 8, 16, 32], bubble_steps=10, mem_pp=4,
                    mem_microbatches=8, plan_model="gpt3-175b", plan_devices=1024, plan_global_batch=1536,
                    plan_device_gb=80.0),
    },
    "data_parallel": {
        "cpu": dict(**FP32, device="cpu", world_size=2, steps=40, batch_size=16, lr=3e-3, seed=0,
                    n_layer=2, n_head=2, n_embd=64, block_size=64, bucket_cap_mb=0.1,
                    ring_world_sizes=[2, 3, 4], ring_numel=1 << 18, loss_tol=1e-5),
        "ci": dict(**FP32, device="cpu", world_size=2, steps=15, batch_size=8, lr=3e-3, seed=0,
                   n_layer=2, n_head=2, n_embd=64, block_size=32, bucket_cap_mb=0.1,
                   ring_world_sizes=[2, 3], ring_numel=1 << 16, loss_tol=1e-5),
        # GPT-2 small's shape at context 1024, one GPU per rank, every GPU of the node; in bf16 the
        # ranks and one process round in different places, so the bar is 16-bit's, not fp32's 1e-5
        # (make gpu-check holds every strategy to one process in fp32).
        "gpu": dict(**BF16_TF32, device="cuda", world_size="all", steps=200, batch_size="8 per rank", lr=6e-4,
                    seed=0, n_layer=12, n_head=12, n_embd=768, block_size=1024, bucket_cap_mb=25.0,
                    ring_world_sizes="2..world_size", ring_numel=1 << 26, loss_tol=2e-2),
    },
    "memory": {
        "cpu": dict(device="cpu", sizes=[[2, 64, 2], [4, 128, 4], [6, 192, 6]], block_size=128,
                    micro_batch=8, mp_steps=60, mp_batch_size=16, mp_lr=1e-3, fake_7b_ranks=8, seed=0),
        "ci": dict(device="cpu", sizes=[[2, 64, 2], [2, 128, 4], [3, 192, 6]], block_size=64,
                   micro_batch=4, mp_steps=16, mp_batch_size=8, mp_lr=1e-3, fake_7b_ranks=8, seed=0),
        # GPT-2 small's to large's shapes at context 1024 on one GPU, with the CUDA allocator's peak too.
        "gpu": dict(device="cuda", sizes=[[12, 768, 12], [24, 1024, 16], [36, 1280, 20]], block_size=1024,
                    micro_batch=8, mp_steps=300, mp_batch_size=16, mp_lr=3e-4, fake_7b_ranks=8, seed=0),
    },
    "activation_checkpointing": {
        "cpu": dict(device="cpu", seq_lens=[128, 256, 512], depths=[2, 4], n_embd=128, n_head=4,
                    micro_batch=4, policies=["none", "every:2", "selective", "selective:alternate", "full"], repeats=7,
                    budget_model="llama2-7b", budget_devices=8, budget_gb=80.0, seed=0),
        "ci": dict(device="cpu", seq_lens=[128, 256], depths=[2, 4], n_embd=64, n_head=2,
                   micro_batch=4, policies=["none", "every:2", "selective", "selective:alternate", "full"], repeats=7,
                   budget_model="llama2-7b", budget_devices=8, budget_gb=80.0, seed=0),
        "gpu": dict(device="cuda", seq_lens=[1024, 2048, 4096], depths=[12, 24], n_embd=1024, n_head=16,
                    micro_batch=4, policies=["none", "every:2", "selective", "selective:alternate", "full"], repeats=7,
                    budget_model="llama2-7b", budget_devices=8, budget_gb=80.0, seed=0),
    },
    "zero_fsdp": {
        "cpu": dict(device="cpu", world_size=2, steps=30, batch_size=16, lr=3e-3, seed=0, n_layer=2, n_head=2,
                    n_embd=64, block_size=64, sweep_world_sizes=[1, 2, 4], sweep_steps=3, grad_accum=2,
                    claim_model="llama2-7b", claim_world_sizes=[4, 8, 64]),
        "ci": dict(device="cpu", world_size=2, steps=20, batch_size=8, lr=3e-3, seed=0, n_layer=2, n_head=2,
                   n_embd=64, block_size=32, sweep_world_sizes=[1, 2, 4], sweep_steps=2, grad_accum=2,
                   claim_model="llama2-7b", claim_world_sizes=[4, 8, 64]),
        # GPT-2 small's shape at context 1024, one GPU per rank on every GPU of the node.
        "gpu": dict(device="cuda", world_size="all", steps=100, batch_size="8 per rank", lr=6e-4, seed=0,
                    n_layer=12, n_head=12, n_embd=768, block_size=1024, sweep_world_sizes="1..world_size",
                    sweep_steps=5, grad_accum=2, claim_model="llama2-7b", claim_world_sizes=[4, 8, 64]),
    },
    "strategy_cost": {
        # write_minutes, restart_minutes: what one checkpoint and one restart cost (assumptions)
        # interrupted_share, share_periods: the published 5-15% bands, read both ways (per month as AWS's
        # Spot Instance Advisor means them, per day); article_lost: the popular article's figure for
        # the preemption at hour 14 (its arithmetic is checked against its own run, not assumed)
        # price_batch: the 10B run's global batch, sequences of 2,048 tokens (4M tokens a step)
        "cpu": dict(tokens=1e12, target_days=30, price_batch=2048, run_cost=18000.0, run_hours=24.0, hours_in=14.0,
                    interrupted_share=[0.05, 0.15], share_periods=["month", "day"], instances=100,
                    article_lost=17250.0, checkpoint_minutes=[10, 30, 60], write_minutes=2.0,
                    restart_minutes=10.0,
                    # the CPU prediction: labkit.labs.cpu_prediction.LAYOUTS trained on this machine's CPU
                    # (cpu_prediction=False skips that section: the rest is arithmetic)
                    cpu_prediction=True, cpu_n_layer=4, cpu_n_head=4, cpu_n_embd=64, cpu_block_size=64,
                    cpu_batch=16, cpu_steps=6),
    },
    "input_pipeline": {
        # threads=1: with DataLoader workers on 2 cores, a 2-thread step fights them for the cores.
        "cpu": dict(device="cpu", threads=1, seed=0, n_layer=2, n_head=2, n_embd=64, block_size=128,
                    batch_size=8, steps=24, synth_load_ms=80.0, synth_compute_ms=50.0, synth_steps=16,
                    synth_workers=[0, 1, 2, 3], io_ms=6.0, cpu_ms=4.0, io_workers=[0, 1, 2, 4],
                    cpu_workers=[0, 1, 2], tail_io_ms=0.5, slow_every=128, slow_ms=300.0,
                    prefetch_factors=[1, 8], setup_ms=300.0, epochs=4, epoch_batches=5, straggler_steps=12,
                    slow_io_ms=6.0,
                    copy_mb=0),
        "ci": dict(device="cpu", threads=1, seed=0, n_layer=2, n_head=2, n_embd=64, block_size=128,
                   batch_size=8, steps=10, synth_load_ms=80.0, synth_compute_ms=50.0, synth_steps=10,
                   synth_workers=[0, 1, 2], io_ms=6.0, cpu_ms=4.0, io_workers=[0, 1, 2, 4],
                   cpu_workers=[0, 2], tail_io_ms=0.5, slow_every=128, slow_ms=300.0,
                   prefetch_factors=[1, 8], setup_ms=200.0, epochs=3, epoch_batches=4, straggler_steps=6,
                   slow_io_ms=6.0,
                   copy_mb=0),
        # GPT-2 small's shape at context 1024 on one GPU (two for the straggler), per-sample costs scaled to
        # its ~100 ms step; copy_mb: a batch large enough (images, say) for pinning to matter.
        "gpu": dict(device="cuda", threads=None, seed=0, n_layer=12, n_head=12, n_embd=768, block_size=1024,
                    batch_size=8, steps=40, synth_load_ms=80.0, synth_compute_ms=50.0, synth_steps=16,
                    synth_workers=[0, 1, 2, 3], io_ms=25.0, cpu_ms=15.0, io_workers=[0, 1, 2, 4, 8],
                    cpu_workers=[0, 1, 2, 4], tail_io_ms=2.0, slow_every=128, slow_ms=1200.0,
                    prefetch_factors=[1, 8], setup_ms=2000.0, epochs=4, epoch_batches=8, straggler_steps=20,
                    slow_io_ms=25.0,
                    copy_mb=256),
    },
    "packing": {
        "cpu": dict(device="cpu", capacity=256, batch_size=16, megabatch=50, steps=60, warmup=5, lr=3e-3,
                    n_layer=2, n_head=2, n_embd=64, article_n=100_000, article_min=50, article_max=512,
                    article_batch=32, article_medians=[10, 25, 50, 80, 120, 200, 300], bench_n=100_000, seed=0),
        "ci": dict(device="cpu", capacity=256, batch_size=8, megabatch=50, steps=20, warmup=2, lr=3e-3,
                   n_layer=2, n_head=2, n_embd=64, article_n=20_000, article_min=50, article_max=512,
                   article_batch=32, article_medians=[10, 25, 50, 80, 120, 200, 300], bench_n=20_000, seed=0),
        # GPT-2 small's shape at context 1024 on one GPU: the rows a real run would pack.
        "gpu": dict(device="cuda", capacity=1024, batch_size=8, megabatch=50, steps=100, warmup=10, lr=6e-4,
                    n_layer=12, n_head=12, n_embd=768, article_n=1_000_000, article_min=50, article_max=512,
                    article_batch=32, article_medians=[10, 25, 50, 80, 120, 200, 300], bench_n=200_000, seed=0),
    },
}
# The wire: collectives timed over message sizes, overlap seen in traces, HSDP, a slow run diagnosed.
_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv"]
PROFILES["communication"] = {
    "cpu": dict(**FP32, device="cpu", world_size=2, ops=_OPS, min_bytes=256, max_bytes=16 << 20, step_factor=4,
                target_ms=40.0, n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16, steps=4,
                lr=1e-3, seed=0, bucket_mbs=[0.01, 0.25, 25.0], accum=4, hsdp_world=4, replicas=2, hsdp_nodes=8,
                slow_rows=1, fast_rows=8, input_delay_ms=30.0, slow_link_gbps=0.02, slow_link_ms=2.0, diag_steps=8),
    "ci": dict(**FP32, device="cpu", world_size=2, ops=_OPS, min_bytes=256, max_bytes=4 << 20, step_factor=4,
               target_ms=20.0, n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=8, steps=4,
               lr=1e-3, seed=0, bucket_mbs=[0.01, 0.25, 25.0], accum=4, hsdp_world=4, replicas=2, hsdp_nodes=8,
               slow_rows=1, fast_rows=4, input_delay_ms=20.0, slow_link_gbps=0.02, slow_link_ms=2.0, diag_steps=5),
    # GPT-2 small's shape on every GPU of a node; messages up to 256 MB, as nccl-tests runs them.
    "gpu": dict(**BF16_TF32, device="cuda", world_size="all", ops=_OPS, min_bytes=256, max_bytes=256 << 20,
                step_factor=4, target_ms=50.0, n_layer=12, n_head=12, n_embd=768, block_size=1024,
                batch_size="8 per rank", steps=6, lr=6e-4, seed=0, bucket_mbs=[0.25, 5.0, 25.0], accum=4,
                hsdp_world=4, replicas=2, hsdp_nodes=8, slow_rows=1, fast_rows=8, input_delay_ms=100.0, slow_link_gbps=1.0,
                slow_link_ms=0.05, diag_steps=8),
}
# Long sequences and many experts: context parallelism and a mixture of experts, each against one process.
# MoE: bias_rate is DeepSeek-V3's bias update speed (its 1e-3 over trillions of tokens; 1e-2 moves the
# biases within the lab's tens of steps); node_*: CPU ranks grouped as nodes, in every profile.
_LCE = dict(attn_heads=4, attn_head_dim=16, top_k=2, aux_weight=0.01, ep_capacity_factor=4.0, seed=0,
            bias_rate=0.01, drop_capacity_factor=1.0, fine_factor=4, shared_experts=1, node_world=4,
            node_ranks=2, node_experts=16, node_top_k=4, node_limit=1, node_tokens=64)
PROFILES["long_context_experts"] = {
    "cpu": dict(**FP32, **_LCE, device="cpu", world_size=2, attn_lengths=[64, 256], balance_world=4, n_layer=2,
                n_head=4, n_embd=64, block_size=128, batch_size=4, steps=10, lr=1e-3, act_rows=2,
                cp_degrees=[1, 2, 4], experts=4, moe_steps=150, capacity_factors=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0]),
    "ci": dict(**FP32, **_LCE, device="cpu", world_size=2, attn_lengths=[32, 64], balance_world=4, n_layer=2,
               n_head=4, n_embd=64, block_size=32, batch_size=4, steps=4, lr=1e-3, act_rows=2,
               cp_degrees=[1, 2, 4], experts=4, moe_steps=60, capacity_factors=[0.5, 1.0, 1.5, 2.0]),
    # GPT-2 small's width on every GPU of a node (the attention checks stay on CPU processes)
    "gpu": dict(**FP32, **_LCE, device="cuda", world_size="all", attn_lengths=[1024, 4096], balance_world=4,
                n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size="8 per rank", steps=20, lr=6e-4,
                act_rows=1, cp_degrees=[1, 2, 4], experts=8, moe_steps=200,
                capacity_factors=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0]),
}
# Fine-tuning: a GPT pretrained in the lab, then full, LoRA and QLoRA on torch.nn's source; the batch.
# micro_batch x accum rows per pretraining step: the two batch sizes of the noise scale; ft_*: fine-tuning.
# LoRA's adapters take a higher learning rate than full fine-tuning's weights (here 5x, from a sweep).
_FT = dict(seed=0, micro_batch=4, accum=4, ft_batch=16, calc_rank=16, scenario_model="llama2-70b",
           scenario_device="a100-80gb", scenario_devices=8, scenario_rank=16, rank_counts=[1, 2, 4, 8, 16, 32, 64])
_FT_CPU = dict(**_FT, device="cpu", n_layer=2, n_head=2, n_embd=64, block_size=64, pretrain_lr=3e-3, full_lr=2e-3,
               lora_lr=1e-2, accum_lr=1e-3)
PROFILES["finetuning"] = {
    "cpu": dict(**_FT_CPU, pretrain_steps=300,
                noise_window=50, ft_steps=100, ranks=[2, 8, 32], qlora_rank=8, eval_batches=8, sample_tokens=240,
                accum_batch=32, accums=[1, 2, 4, 8], accum_steps=10, sweep_batches=[2, 8, 32],
                sweep_lrs=[5e-4, 1e-3, 2e-3, 4e-3, 8e-3], sweep_steps=60),
    "ci": dict(**_FT_CPU, pretrain_steps=150,
               noise_window=25, ft_steps=50, ranks=[2, 8, 32], qlora_rank=8, eval_batches=4, sample_tokens=120,
               accum_batch=16, accums=[1, 2, 4], accum_steps=5, sweep_batches=[2, 16],
               sweep_lrs=[5e-4, 1e-3, 2e-3, 4e-3, 8e-3], sweep_steps=25),
    # GPT-2 small's shape at context 1024 on one GPU; QLoRA's 4-bit base on CUDA through bitsandbytes.
    "gpu": dict(**_FT, device="cuda", n_layer=12, n_head=12, n_embd=768, block_size=1024, pretrain_lr=6e-4,
                full_lr=3e-4, lora_lr=1.5e-3, accum_lr=6e-4, pretrain_steps=500,
                noise_window=50, ft_steps=200, ranks=[4, 16, 64], qlora_rank=16, eval_batches=8, sample_tokens=240,
                accum_batch=32, accums=[1, 2, 4, 8], accum_steps=10, sweep_batches=[4, 16, 64],
                sweep_lrs=[1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3], sweep_steps=100),
}
# Pure arithmetic: no profile changes what it computes, but every lab answers to the same names.
PROFILES["strategy_cost"]["ci"] = PROFILES["strategy_cost"]["gpu"] = PROFILES["strategy_cost"]["cpu"]
# Fault tolerance: a torchrun job killed and preempted on purpose, checkpoint costs, the $18,000 run.
_SPOT = dict(run_cost=18000.0, run_hours=24.0, hours_in=14.0, instances=100, interrupted_share=[0.05, 0.15],
             share_periods=["month", "day"], checkpoint_minutes=2.0, restart_minutes=10.0,
             notice_s=30.0, naive_numel=1 << 21, naive_trials=30)  # notice_s: Google Cloud's and Azure's
PROFILES["fault_tolerance"] = {
    "cpu": dict(**FP32, device="cpu", world_size=2, strategy="fsdp", steps=40, batch_size=8, lr=3e-3, seed=0, n_layer=2,
                n_head=2, n_embd=64, block_size=64, dropout=0.1, save_every=5, async_save=True, grace_s=30, fault_seed=0,
                bench_n_layer=6, bench_n_embd=384, bench_n_head=6, bench_repeats=5, **_SPOT),
    "ci": dict(**FP32, device="cpu", world_size=2, strategy="fsdp", steps=16, batch_size=8, lr=3e-3, seed=0, n_layer=2,
               n_head=2, n_embd=64, block_size=32, dropout=0.1, save_every=4, async_save=True, grace_s=30, fault_seed=0,
               bench_n_layer=4, bench_n_embd=256, bench_n_head=4, bench_repeats=5, **_SPOT),
    # GPT-2 small's shape at context 1024, one GPU per rank; the benchmark stages 86 M parameters and Adam from the GPU.
    "gpu": dict(**BF16_TF32, device="cuda", world_size="all", strategy="fsdp", steps=200, batch_size="8 per rank", lr=6e-4, seed=0,
                n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.1, save_every=20, async_save=True,
                grace_s=30, fault_seed=0, bench_n_layer=12, bench_n_embd=768, bench_n_head=12, bench_repeats=3, **_SPOT),
}

PROFILES["failures_at_scale"] = FAILURES_AT_SCALE  # labkit.labs.profiles_failures

# Composing: a 3-D layout (8 ranks) and a 4-D one (16) held to one process, and the chooser's plan for a
# small GPT on 8 devices whose memory only a composed layout fits (plan_*), run as printed.
_PLAN = dict(plan_hidden=64, plan_layers=4, plan_heads=4, plan_devices=8, plan_micro_batch=1)
PROFILES["composing"] = {
    "cpu": dict(**FP32, **_PLAN, device="cpu", layout_3d={"tp": 2, "pp": 2, "dp_shard": 2},
                layout_4d={"tp": 2, "cp": 2, "pp": 2, "dp_shard": 2}, steps=20, steps_4d=10,
                batch_size=16, microbatches=4, lr=1e-3, seed=0, n_layer=4, n_head=4, n_embd=64, block_size=64,
                plan_seq_len=512, plan_device_gb=0.0025, plan_steps=3),
    "ci": dict(**FP32, **_PLAN, device="cpu", layout_3d={"tp": 2, "pp": 2, "dp_shard": 2},
               layout_4d={"tp": 2, "cp": 2, "pp": 2, "dp_shard": 2}, steps=4, steps_4d=2,
               batch_size=8, microbatches=2, lr=1e-3, seed=0, n_layer=2, n_head=4, n_embd=32, block_size=32,
               plan_seq_len=128, plan_device_gb=0.001, plan_steps=2),
    # GPT-2 small's shape at context 1024 on the node's GPUs, the 3-D layout fitted to them (the 4-D one
    # needs 16); the plan for the same model on 8 GPUs of 80 GB at a 32k context.
    "gpu": dict(**BF16_TF32, device="cuda", layout_3d="fit",
                layout_4d={"tp": 2, "cp": 2, "pp": 2, "dp_shard": 2}, steps=50, steps_4d=20,
                batch_size="8 per rank", microbatches=4, lr=6e-4, seed=0, n_layer=12, n_head=12, n_embd=768,
                block_size=1024, plan_hidden=768, plan_layers=12, plan_heads=12, plan_devices=8, plan_micro_batch=1,
                plan_seq_len=32768, plan_device_gb=80.0, plan_steps=10),
}

# One device: its roofs and a GPT block's ops (one thread on CPU), a fused chain, FlashAttention, FP8.
_DEVICE = dict(repeats=5, n_head=4, attn_heads=4, attn_head_dim=32, attn_block=64, attn_check_seq=128,
               fp8_n_layer=2, fp8_n_head=4, fp8_n_embd=128, fp8_block_size=64, fp8_batch=8, fp8_lr=1e-3, seed=0,
               fp8_precisions=["fp32", "bf16", "fp8", "fp8-block"], outlier_ratios=[100, 10000],
               fp8_gemm_n=128)  # torch's CPU _scaled_mm is a slow reference: 512 took 131 s
PROFILES["inside_device"] = {
    "cpu": dict(_DEVICE, device="cpu", dtype="fp32", roof_sizes=[256, 512, 1024], copy_mb=64, n_embd=256,
                seq=256, batch=4, fusion_tokens=[2048, 8192, 32768], fusion_width=256,
                attn_seq_lens=[128, 256, 512, 1024, 2048], fp8_steps=60),
    "ci": dict(_DEVICE, device="cpu", dtype="fp32", roof_sizes=[256, 512, 1024], copy_mb=64, n_embd=256, seq=256,
               batch=2, fusion_tokens=[2048, 8192], fusion_width=256, attn_seq_lens=[128, 256, 512],
               fp8_steps=20),
    # bf16 at a Llama-7B block's width and context
    "gpu": dict(_DEVICE, device="cuda", dtype="bf16", roof_sizes=[4096, 8192], copy_mb=1024, n_embd=4096, n_head=32,
                seq=4096, batch=1, fusion_tokens=[8192, 65536, 262144], fusion_width=4096,
                attn_seq_lens=[1024, 2048, 4096, 8192], fp8_steps=200, fp8_gemm_n=8192),
}

# `make gpu-check` runs every lab's gpu profile with these overrides: the same code paths in a few
# steps, so that the whole check fits in minutes on one GPU (the shapes stay the gpu profile's).
GPU_CHECK: dict[str, dict] = {
    "tensor_parallel": dict(steps=6, sweep_steps=3, steps_2d=4, comm_batch_sizes=[2, 4]),
    "pipeline_parallel": dict(steps=6, bubble_steps=3, bubble_ms=[1, 8]),
    "data_parallel": dict(steps=8, ring_numel=1 << 22),
    "memory": dict(mp_steps=20, sizes=[[12, 768, 12], [24, 1024, 16]]),
    "activation_checkpointing": dict(repeats=3, seq_lens=[1024, 2048], depths=[12]),
    "zero_fsdp": dict(steps=8, sweep_steps=2),
    "input_pipeline": dict(steps=12, synth_steps=8, epochs=2, epoch_batches=4, straggler_steps=8, setup_ms=500.0),
    "packing": dict(steps=20, warmup=4, article_n=200_000, bench_n=50_000),
    "fault_tolerance": dict(steps=40, save_every=10, bench_repeats=2, naive_trials=10),
    "failures_at_scale": dict(sdc_steps=4, straggler_steps=4, bench_repeats=2, elastic_policies=["shrink"]),
    "communication": dict(max_bytes=16 << 20, steps=4, diag_steps=4),
    "long_context_experts": dict(steps=4, moe_steps=20),
    "composing": dict(steps=6, steps_4d=3, plan_steps=2),
    "inside_device": dict(fp8_steps=20, fusion_tokens=[8192, 65536], attn_seq_lens=[1024, 2048]),
    "finetuning": dict(pretrain_steps=20, noise_window=5, ft_steps=5, accum_steps=3, sweep_steps=5,
                       sweep_lrs=[2e-4, 4e-4, 8e-4], sample_tokens=20, eval_batches=2),
}
