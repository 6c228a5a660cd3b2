import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.fault_tolerance.injection import torchrun_command
from labkit.launch import RankError, launch
from labkit.train import TrainConfig, main, train

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def test_single_process_metrics_json(tmp_path):
    out = tmp_path / "m.json"
    assert main(["--strategy", "single", "--steps", "3", "--block-size", "16", "--metrics", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["strategy"] == "single" and m["world_size"] == 1 and len(m["loss"]) == 3
    assert m["config"]["steps"] == 3 and m["model"]["block_size"] == 16
    assert len(m["ranks"]) == 1 and len(m["ranks"][0]["step_time_s"]) == 3
    assert m["ranks"][0]["allreduce_bytes_per_step"] == [0, 0, 0]
    assert m["ranks"][0]["local_loss"] == m["loss"]
    held = m["ranks"][0]["model_state_bytes_per_step"]
    assert len(held) == 3 and held[-1] == m["ranks"][0]["model_state_bytes"]["total"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_matches_single_process(tmp_path, strategy):
    """The cluster recipe (torchrun, 2 ranks) runs the same loop and equals the in-process reference."""
    out = tmp_path / f"{strategy}.json"
    env = {**ENV, "PYTHON": sys.executable, "DEVICE": "cpu", "NPROC": "2", "STRATEGY": strategy,
           "STEPS": "4", "SEED": "3", "METRICS": str(out)}
    if strategy == "ddp":  # as README runs it: no PYTHON, from another folder; it finds the checkout's .venv
        env.pop("PYTHON")
    proc = subprocess.run(["bash", str(ROOT / "cluster" / "torchrun.sh"), "--block-size", "16"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and len(m["ranks"]) == 2
    if strategy == "ddp":
        assert all(r["allreduce_bytes_per_step"] == [m["grad_bytes"]] * 4 for r in m["ranks"])
    assert all(r["model_state_bytes"]["params"] == m["predicted_model_state_bytes"]["params"] for r in m["ranks"])
    # per rank and per step: each rank's own loss (their mean is the global-batch loss) and the
    # model-state bytes it held, which do not change from step to step once Adam's states exist
    for step, loss in enumerate(m["loss"]):
        assert abs(sum(r["local_loss"][step] for r in m["ranks"]) / 2 - loss) < 1e-6
    assert all(len(set(r["model_state_bytes_per_step"])) == 1 and len(r["model_state_bytes_per_step"]) == 4
               for r in m["ranks"])
    from labkit.core.model import GPTConfig

    ref = train(TrainConfig(steps=4, seed=3), GPTConfig(block_size=16))
    assert max(abs(a - b) for a, b in zip(ref["loss"], m["loss"])) < 1e-5


@pytest.mark.parametrize("strategy, extra", [("tp", ["--tp", "2"]),
                                             ("pp", ["--pp", "2", "--microbatches", "4", "--pp-schedule", "1f1b"])])
def test_torchrun_runs_tensor_and_pipeline_parallel(tmp_path, strategy, extra):
    """``--strategy tp`` and ``--strategy pp`` through the same recipe: one loss per step equal to one
    process's, per-rank figures, and the pipeline's bubble."""
    out = tmp_path / f"{strategy}.json"
    env = {**ENV, "PYTHON": sys.executable, "DEVICE": "cpu", "NPROC": "2", "STRATEGY": strategy,
           "STEPS": "3", "SEED": "3", "METRICS": str(out)}
    proc = subprocess.run(["bash", str(ROOT / "cluster" / "torchrun.sh"), "--block-size", "16", "--n-layer", "2",
                           "--lr", "1e-3", *extra], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and len(m["loss"]) == 3 and len(m["ranks"]) == 2
    from labkit.core.model import GPTConfig

    # each rank holds its own part of the model (and AdamW's 4-byte step counters on top)
    held = [4 * n for n in m["predicted_params_per_rank"]] if strategy == "pp" else \
        [m["predicted_model_state_bytes"]["params"]] * 2
    assert [r["model_state_bytes"]["params"] for r in m["ranks"]] == held, (m["ranks"], held)
    assert all(r["model_state_bytes"]["grads"] == h and 0 <= r["model_state_bytes"]["optimizer"] - 2 * h <= 4 * 64
               for r, h in zip(m["ranks"], held))
    if strategy == "pp":
        # the first stage embeds, the last predicts with the same (tied) matrix: both hold a copy
        tied = GPTConfig().vocab_size * GPTConfig().n_embd
        assert 0 < m["bubble_fraction"] < 1 and sum(m["predicted_params_per_rank"]) == m["n_params"] + tied

    ref = train(TrainConfig(steps=3, seed=3, lr=1e-3), GPTConfig(block_size=16, n_layer=2))
    assert max(abs(a - b) for a, b in zip(ref["loss"], m["loss"])) < 1e-5


def test_cli_rejects_unknown_strategy():
    proc = subprocess.run([sys.executable, "-m", "labkit.train", "--strategy", "bogus"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "invalid choice: 'bogus'" in proc.stderr and "ddp" in proc.stderr


def test_cli_help_runs():
    proc = subprocess.run([sys.executable, "-m", "labkit.train", "--help"], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--strategy" in proc.stdout and "--metrics" in proc.stdout


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="zero9"), r"strategy='zero9' is unknown; valid strategies: \['single', 'ddp'"),
    (dict(steps=0), "steps must be a positive integer"),
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(lr=0.0), "lr must be a positive finite number"),
    (dict(device="tpu"), "device='tpu' is unknown; valid devices"),
])
def test_bad_train_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_world_size_that_cannot_split_the_batch_fails_on_every_rank_with_its_name():
    with pytest.raises(RankError, match=r"world_size=3 does not divide the global batch_size=8"):
        launch(train, TrainConfig(strategy="ddp", steps=1, batch_size=8), world_size=3)


def test_progress_bar_on_long_runs(capsys):
    train(TrainConfig(steps=3, progress=True), None)
    err = capsys.readouterr().err
    assert "single x1" in err and "3/3" in err


def test_deepspeed_launcher_runs_the_same_entry_point(tmp_path):
    """`deepspeed --module labkit.train` (it passes --local_rank) trains ZeRO-2 like torchrun does."""
    from labkit.core.ports import listen_port

    port = listen_port()
    out = tmp_path / "zero2.json"
    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--num_accelerators", "2", "--master_port", str(port), "--module", "labkit.train",
           "--strategy", "zero2", "--steps", "3", "--block-size", "16", "--metrics", str(out)]
    proc = subprocess.run(cmd, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    m = json.loads(out.read_text())
    assert m["strategy"] == "zero2" and m["world_size"] == 2
    from labkit.core.model import GPTConfig

    ref = train(TrainConfig(steps=3), GPTConfig(block_size=16))
    assert max(abs(a - b) for a, b in zip(ref["loss"], m["loss"])) < 1e-5


# Each DeepSpeed strategy, under torchrun, started and ended this many times. Before labkit.launch's
# leave_group put a barrier last, about 1 run in 10 aborted at interpreter exit (SIGABRT) after
# training had finished, and torchrun reported a failure; 120 single-rank runs and 60 torchrun runs
# after the fix all exited 0 (the closing notes of the changes). CI affords one per strategy (each
# start of torch and DeepSpeed on two ranks costs ~15 s here); LABKIT_EXIT_TRIALS=20 is the soak.
EXIT_TRIALS = int(os.environ.get("LABKIT_EXIT_TRIALS", "1"))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_runs_exit_0_every_time_under_torchrun(strategy):


    cmd = torchrun_command(["--strategy", strategy, "--steps", "1", "--block-size", "8", "--n-embd", "16"],
                           max_restarts=0)
    for trial in range(EXIT_TRIALS):
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (trial, proc.stderr[-2000:])


@pytest.mark.parametrize("strategy, extra, moe", [
    ("cp", ["--cp", "2"], {}),
    ("ep", ["--ep", "2", "--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "4"],
     dict(moe_experts=4, moe_top_k=2, moe_capacity_factor=4.0))])
def test_torchrun_runs_context_and_expert_parallel(tmp_path, strategy, extra, moe):
    """The issue's commands: `torchrun --nproc-per-node 2 -m labkit.train --strategy cp --cp 2` and
    `--strategy ep --ep 2 --moe-experts 4 --moe-top-k 2`, each equal to one process within 1e-5."""
    from labkit.core.model import GPTConfig

    out = tmp_path / f"{strategy}.json"
    cmd = torchrun_command(["--strategy", strategy, *extra, "--steps", "3", "--seed", "3", "--block-size", "16",
                            "--lr", "1e-3", "--metrics", str(out)], max_restarts=0)
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and m[strategy] == 2
    ref = train(TrainConfig(steps=3, seed=3, lr=1e-3), GPTConfig(block_size=16, **moe))
    assert max(abs(a - b) for a, b in zip(ref["loss"], m["loss"])) < 1e-5
