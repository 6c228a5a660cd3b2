"""The failures-at-scale lab's profiles (:data:`labkit.labs.profiles.PROFILES` holds them under its name).
"""
from __future__ import annotations

# Failures at scale: Llama 3's failure rate over N, a flipped bit found by a cross-replica fingerprint, a
# straggler found by rank, peer in-memory checkpoints and replicas that train through a lost one, each
# against a reference. The elastic jobs run as CPU processes over gloo on every profile (re-creating an
# NCCL group after a peer dies needs an abort torchft wraps: labkit.fault_tolerance.quorum).
# straggler_ms on CPU: three ranks share two cores, so the others' compute swings by 2-3x; a 50 ms
# delay was lost in that once (1.49x against find_stragglers' 1.5x), 250 ms stands out of any such swing.
# stale_s: a worker whose heartbeat is older is taken for dead (0.5 s left a survivor out once, its
# beats late on cores shared by eight processes; a replacement's own beat tells its death at once);
# min_step_ms: a floor under the elastic step, as a real model's step outlasts a replacement's
# start-up; bytes_per_param, scenario_params:
# the checkpoint the goodput model prices per GPU (fp32 master weights and Adam's two moments of Llama 3
# 405B, over its 16,384 GPUs); job_restart_min: what restarting a whole job costs at scale (an
# assumption, the fault-tolerance chapter's 10 minutes).
_FAS = dict(seed=0, lr=1e-3, flip_tensor="blocks.0.mlp.fc.weight", flip_index=1234, flip_bit=30, flip_step=3,
            flip_rank=2, straggler_rank=1, peer_replicas=2, elastic_replicas=3, kill_replica=1, elastic_batch=12,
            stale_s=2.0, timeout_s=240.0, gpu_counts=[1024, 4096, 16384, 65536, 131072],
            scenario_params=405e9, bytes_per_param=12, job_restart_min=10.0)
FAILURES_AT_SCALE: dict[str, dict] = {
    "cpu": dict(_FAS, device="cpu", world_size=3, n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=12,
                sdc_steps=10, straggler_steps=10, straggler_ms=250.0, bench_mb=128, bench_repeats=3,
                elastic_shape=[2, 2, 64, 64], peer_steps=12, peer_kill_step=4, elastic_policies=["shrink", "cover"],
                elastic_steps=50, elastic_kill_step=3, min_step_ms=150.0),
    "ci": dict(_FAS, device="cpu", world_size=3, n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=12,
               sdc_steps=6, straggler_steps=6, straggler_ms=250.0, bench_mb=32, bench_repeats=2,
               elastic_shape=[2, 2, 64, 32], peer_steps=8, peer_kill_step=3, elastic_policies=["shrink"],
               elastic_steps=36, elastic_kill_step=3, min_step_ms=100.0),
    # GPT-2 small's shape on every GPU of a node for the fingerprint and the straggler (NCCL; on two
    # GPUs the vote is a tie: detected, not attributed), rank 1 the faulty one; the elastic jobs keep
    # the CPU model.
    "gpu": dict(_FAS, flip_rank=1, device="cuda", world_size="all", n_layer=12, n_head=12, n_embd=768, block_size=1024,
                batch_size="8 per rank", sdc_steps=10, straggler_steps=10, straggler_ms=100.0, bench_mb=512,
                bench_repeats=3, elastic_shape=[2, 2, 64, 64], peer_steps=12, peer_kill_step=4,
                elastic_policies=["shrink", "cover"], elastic_steps=50, elastic_kill_step=3, min_step_ms=150.0),
}
