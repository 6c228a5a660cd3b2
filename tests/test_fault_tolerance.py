"""Checkpoints that survive kills, corruption, planted pickles and full disks; bit-exact resume."""
import errno
import json
import os
import pickle
import random
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from ft_rank_fns import Payload, deepspeed_resume, resign
from labkit.fault_tolerance.injection import Fault, read_log, run_with_faults
from labkit.fault_tolerance import LOCAL, CheckpointError, Checkpointer
from labkit.launch import launch
from labkit.core.model import GPT, GPTConfig
from labkit.fault_tolerance.preemption import EXIT, SAVE_AND_EXIT, PreemptionHandler, REQUEUE_EXIT_CODE
from labkit.train import TrainConfig, main, train, train_many
from labkit.train.cli import to_flags


def _state(step: int, n: int = 4096) -> dict:
    """A small state whose every value says which step it belongs to."""
    return {"model": {"w": torch.full((n,), float(step)), "b": torch.arange(7) + step},
            "step": step, "cfg": {"betas": (0.9, 0.95), "name": f"s{step}", "none": None},
            LOCAL: {"rng": torch.full((3,), step, dtype=torch.uint8)}}


def _check(state: dict, step: int) -> None:
    assert state["step"] == step and state["cfg"] == {"betas": (0.9, 0.95), "name": f"s{step}", "none": None}
    assert torch.equal(state["model"]["w"], torch.full_like(state["model"]["w"], float(step)))
    assert torch.equal(state["model"]["b"], torch.arange(7) + step)
    assert torch.equal(state[LOCAL]["rng"], torch.full((3,), step, dtype=torch.uint8))


def test_single_process_round_trip_retention_and_template(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        stats = ckpt.save(step, _state(step))
        assert stats.done and stats.bytes > 4096 * 4 and stats.blocking_s == stats.total_s
    assert ckpt.steps() == [2, 3] and (tmp_path / "latest").read_text() == "step_00000003"
    step, state = ckpt.load_latest()
    assert step == 3
    _check(state, 3)
    template = {"model": {"w": torch.zeros(4096), "b": torch.zeros(7, dtype=torch.int64)}}
    step, state = Checkpointer(tmp_path, readonly=True).load_latest(template)
    assert state["model"]["w"] is template["model"]["w"]  # loaded in place
    _check(state, 3)
    assert Checkpointer(tmp_path / "empty").load_latest() is None
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) the template lacks, e.g. \['model/b'\]"):
        Checkpointer(tmp_path, readonly=True).load_latest({"model": {"w": torch.zeros(4096)}})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(keep_last=0), ValueError, "keep_last must be a positive integer, got 0"),
    (dict(hash="md5"), ValueError, r"hash='md5' is unknown; valid hashes: \['xxh3_64'"),
])
def test_bad_checkpointer_arguments_are_named(tmp_path, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Checkpointer(tmp_path, **kwargs)


def test_bad_states_and_directories_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="directory=.* is not a writable directory"):
        Checkpointer(tmp_path / "file" / "ckpt")
    ckpt = Checkpointer(tmp_path / "c")
    with pytest.raises(TypeError, match=r"state\['opt/lock'\] is a set"):
        ckpt.save(1, {"opt": {"lock": {1, 2}}})
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        ckpt.save(-1, {})
    assert ckpt.steps() == []


def _saver(directory: str, async_save: bool, report: int) -> None:
    """Child of a fork: save steps 1, 2, 3, ... back to back until killed; after each save() returns,
    write one byte to the ``report`` pipe so the parent knows saves are under way."""
    torch.set_num_threads(1)  # no OpenMP pool in a forked child
    ckpt = Checkpointer(directory, keep_last=2, async_save=async_save)
    step = (ckpt.steps() or [0])[-1] + 1
    while True:
        ckpt.save(step, _state(step, 1 << 16))
        os.write(report, b".")
        step += 1


def _wait_for_saves(fd: int, count: int, timeout_s: float = 60.0) -> None:
    deadline, got = time.monotonic() + timeout_s, 0
    while got < count:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"the saver reported {got}/{count} saves"
        chunk = os.read(fd, 64)
        assert chunk, "the saver died"
        got += len(chunk)


def test_kill_at_random_instants_always_leaves_the_newest_good_checkpoint(tmp_path):
    """At least 20 SIGKILLs at random instants of back-to-back saves (sync and async), and more until 5
    kills landed inside a save and the checkpoint advanced 5 times; after every kill the newest checkpoint verifies
    and loads, the step never goes back, and leftovers are cleaned."""
    rng = random.Random(1234)
    best, torn, advanced, trial = 0, 0, 0, 0
    # The kill waits until the child has returned from two saves, so each trial starts from a save in
    # flight whatever the machine's load; how many trials it takes to land 5 kills mid-write is random.
    while trial < 20 or torn < 5 or advanced < 5:
        assert trial < 80, f"after 80 kills only {torn} landed mid-save and {advanced} advanced"
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            try:
                os.close(read_end)
                _saver(str(tmp_path), async_save=trial % 2 == 1, report=write_end)
            finally:
                os._exit(0)
        os.close(write_end)
        try:
            _wait_for_saves(read_end, 2)
            time.sleep(rng.uniform(0.0, 0.05))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
        torn += any(tmp_path.glob(".tmp-*"))
        ckpt = Checkpointer(tmp_path, keep_last=2)  # cleans what the killed save left
        assert not any(tmp_path.glob(".tmp-*")) and not any(tmp_path.glob(".trash-*"))
        assert all(ckpt.verify(s) == [] for s in ckpt.steps()), f"trial {trial}: a published checkpoint is torn"
        got = ckpt.load_latest()
        assert got is not None, f"trial {trial}: no checkpoint after two completed saves"
        step, state = got
        _check(state, step)
        assert step >= best, f"trial {trial}: went back from step {best} to {step}"
        advanced += step > best
        best = step
        trial += 1
        ckpt.close()  # the next saver is its directory's one writer


def test_a_flipped_byte_in_any_file_is_detected_and_the_previous_checkpoint_used(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=3)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    path = tmp_path / "step_00000002"
    files = sorted(p for p in path.rglob("*") if p.is_file())
    assert {p.name for p in files} >= {"manifest.json", ".metadata", "rank0.pt", "__0_0.distcp"}
    rng = random.Random(0)
    for f in files:
        data = bytearray(f.read_bytes())
        for offset in (0, len(data) - 1, rng.randrange(len(data))):
            flipped = bytearray(data)
            flipped[offset] ^= 1 << rng.randrange(8)
            f.write_bytes(flipped)
            problems = ckpt.verify(2)
            assert problems and any(f.name in p for p in problems), (f.name, offset, problems)
            with pytest.warns(UserWarning, match="step_00000002 is unusable"):
                step, state = ckpt.load_latest()
            assert step == 1 and ckpt.last_load.skipped[0][0] == 2
            _check(state, 1)
        f.write_bytes(data)
    assert ckpt.verify(2) == [] and ckpt.load_latest()[0] == 2


@pytest.mark.parametrize("victim", ["rank0.pt", ".metadata"])
def test_a_planted_malicious_pickle_is_refused(tmp_path, victim):
    ckpt = Checkpointer(tmp_path / "c", keep_last=3)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    marker = tmp_path / "pwned"
    (tmp_path / "c" / "step_00000002" / victim).write_bytes(pickle.dumps(Payload(str(marker))))
    resign(ckpt.dir, 2)  # the manifest agrees: integrity checks are not a security boundary
    assert ckpt.verify(2) == []
    with pytest.warns(UserWarning, match="refused to load"):
        step, state = ckpt.load_latest()
    assert not marker.exists() and step == 1
    _check(state, 1)


def test_disk_full_during_save_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, _state(1))
    real_fsync = os.fsync

    def full_disk_fsync(fd):  # file systems report a full disk at write or, delayed, at fsync
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_fsync)
    with pytest.raises(CheckpointError, match=r"saving step 2 .* No space left on device.*step 1, is intact"):
        ckpt.save(2, _state(2))
    monkeypatch.undo()
    assert ckpt.steps() == [1] and not any(tmp_path.glob(".tmp-*"))
    _check(ckpt.load_latest()[1], 1)


def test_a_real_write_failure_past_the_file_size_limit(tmp_path):
    """The kernel refuses the write itself (RLIMIT_FSIZE: EFBIG) in a forked child."""
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, _state(1))
    ckpt.close()  # the child is the directory's one writer
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        try:
            torch.set_num_threads(1)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get the error, not the signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
            try:
                Checkpointer(tmp_path, keep_last=1).save(2, _state(2, 1 << 16))
                msg = "saved"
            except CheckpointError as e:
                msg = str(e)
            os.write(w, msg.encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    msg = os.read(r, 4000).decode()
    # torch's zip writer reports a failed write(2) as a position mismatch, not as EFBIG
    assert msg.startswith(f"saving step 2 to {tmp_path} failed (rank 0: ") and "step 1, is intact" in msg, msg
    assert Checkpointer(tmp_path, readonly=True).steps() == [1] and not any(tmp_path.glob(".tmp-*"))


def test_async_save_blocks_only_for_the_snapshot_and_writes_it(tmp_path, monkeypatch):
    """save() returns once the tensors are staged, while the write itself is still held back (no
    timing: the writer waits on an event the test sets); what it writes is the state at save()."""
    state = {"w": torch.randn(1 << 16)}
    expected = state["w"].clone()
    ckpt = Checkpointer(tmp_path, keep_last=1, async_save=True)
    ckpt.save(1, {"w": torch.zeros(4)})
    ckpt.wait()
    release, writing = threading.Event(), threading.Event()
    real_write = Checkpointer._write

    def held_write(self, *args):
        writing.set()
        assert release.wait(60), "the test never released the writer"
        return real_write(self, *args)

    monkeypatch.setattr(Checkpointer, "_write", held_write)
    stats = ckpt.save(2, state)  # returns although the writer cannot write yet
    assert writing.wait(60) and not stats.done and ckpt.steps() == [1]  # the old one stays until the new one is durable
    state["w"].add_(1.0)  # training goes on at once
    release.set()
    done = ckpt.wait()
    assert done is stats and done.done and ckpt.steps() == [2]
    assert torch.equal(ckpt.load_latest()[1]["w"], expected)
    assert 0 < stats.blocking_s <= stats.total_s


def test_preemption_handler_agrees_on_save_or_exit():
    with pytest.raises(ValueError, match="grace_s must be a non-negative finite number"):
        PreemptionHandler(grace_s=-1)
    previous = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler(grace_s=5.0, reserve_s=1.0) as h:
        assert h.poll(100.0) == "continue"
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert h.signal_name == "SIGUSR1" and 3.5 < h.time_left() <= 5.0
        assert h.poll(1.0) == SAVE_AND_EXIT and h.poll(10.0) == EXIT
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_sigterm_in_the_cli_saves_exits_75_and_the_rerun_resumes(tmp_path):
    log = tmp_path / "log.jsonl"
    args = ["--steps", "400", "--block-size", "16", "--n-layer", "1", "--checkpoint-dir", str(tmp_path / "ck"),
            "--step-log", str(log)]

    def notice():  # the spot notice arrives once training is under way
        while not any(e["event"] == "step" and e["step"] >= 3 for e in read_log(log)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=notice, daemon=True).start()
    assert main(args) == REQUEUE_EXIT_CODE
    pre = [e for e in read_log(log) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["saved"] and pre[0]["signal"] == "SIGTERM"
    assert Checkpointer(tmp_path / "ck", readonly=True).steps()[-1] == pre[0]["step"]
    assert signal.getsignal(signal.SIGTERM) is before  # given back
    out = tmp_path / "m.json"
    assert main([*args[:1], str(pre[0]["step"] + 2), *args[2:], "--metrics", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["start_step"] == pre[0]["step"] and len(m["loss"]) == pre[0]["step"] + 2


def test_a_death_signal_to_the_recipes_torchrun_is_one_line_and_the_ranks_still_save(tmp_path):
    """Slurm stops a job it preempts, cancels or times out with SIGTERM to every process of it, torchrun
    and its ranks alike; torchrun answered with a SignalException traceback per node. Under
    ``python -m labkit.launch.torchrun``, as train.sbatch runs it, that is one line, and the ranks save."""
    log = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "labkit.launch.torchrun", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "labkit.train", "--device", "cpu", "--steps", "2000",
           "--block-size", "16", "--n-layer", "1", "--input-delay-ms", "20", "--checkpoint-dir", str(tmp_path / "ck"),
           "--step-log", str(log), "--grace-s", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "step" and e["step"] >= 3 for e in read_log(log)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # as Slurm signals a job: every process of it at once
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "Traceback" not in err and "SignalException" not in err, err
    assert "stopped by SIGTERM, as Slurm stops a job it preempts, cancels or times out" in err, err
    pre = [e for e in read_log(log) if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["saved"] and pre[0]["signal"] == "SIGTERM"


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr_schedule="linear"), r"lr_schedule='linear' is unknown; valid schedules: \['constant', 'cosine'\]"),
    (dict(keep_last=0), "keep_last must be a positive integer"),
    (dict(save_every=-1), "save_every must be a non-negative integer"),
    (dict(strategy="zero1_scratch", checkpoint_dir="x"), "checkpoint_dir is not supported with strategy='zero1_scratch'"),
    (dict(strategy="zero2", async_save=True), "async_save=True is not supported with strategy='zero2'"),
    (dict(reserve_s=-1.0), "reserve_s must be a non-negative finite number"),
    (dict(checkpoint_dir="x", grace_s=1.5),
     r"reserve_s=2.0 leaves nothing of grace_s=1.5 for saving; use reserve_s < grace_s \(e.g. reserve_s=0.375; "
     r"--reserve-s"),
])
def test_bad_fault_tolerance_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_bad_faults_are_named():
    with pytest.raises(ValueError, match=r"signal='SIGSTOP' is unknown; valid: \['SIGKILL', 'SIGTERM', 'SIGUSR1'\]"):
        Fault(3, "SIGSTOP")
    with pytest.raises(ValueError, match="target='rank1' must be a rank"):
        Fault(3, "SIGKILL", "rank1")
    with pytest.raises(ValueError, match="target=True must be a rank"):
        Fault(3, "SIGKILL", True)
    with pytest.raises(ValueError, match="step must be a non-negative integer, got -1"):
        Fault(-1)
    with pytest.raises(ValueError, match="must not set --step-log"):
        run_with_faults(["--step-log", "x"], [], "log.jsonl")


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    cfg = TrainConfig(steps=2, checkpoint_dir=str(tmp_path))
    train(cfg, GPTConfig(block_size=16, n_layer=1))
    with pytest.raises(ValueError, match="saved with seed=0 but this run has seed=1"):
        train(TrainConfig(steps=3, seed=1, checkpoint_dir=str(tmp_path)), GPTConfig(block_size=16, n_layer=1))
    with pytest.raises(ValueError, match=r"saved with a model of n_layer=1 but this run has n_layer=2: its para"):
        train(TrainConfig(steps=3, checkpoint_dir=str(tmp_path)), GPTConfig(block_size=16, n_layer=2))
    assert Checkpointer(tmp_path, readonly=True).steps() == [2]  # refused, not skipped and overwritten
    with pytest.raises(ValueError, match="already holds checkpoints up to step 2; with resume=False"):
        train(TrainConfig(steps=3, resume=False, checkpoint_dir=str(tmp_path)), GPTConfig(block_size=16, n_layer=1))
    assert signal.getsignal(signal.SIGTERM) is before  # a refused resume leaves no handler behind


# -- bit-exact resume under torchrun: real SIGKILLs and SIGTERMs at random steps --
STEPS = 14
MODEL = GPTConfig(block_size=16, dropout=0.1)  # dropout: a resume that loses the RNG state shows
BASE = dict(steps=STEPS, lr_schedule="cosine", warmup_steps=2)  # so does one that loses the scheduler


def _job(tmp_path, strategy: str, faults: list[tuple[str, int]]) -> tuple[list[Fault], dict]:
    rng = random.Random(strategy)  # random kill points, the same on every run of the test
    first = rng.randint(2, 6)
    points = [Fault(first, *faults[0]), Fault(rng.randint(first + 2, STEPS - 2), *faults[1])]
    cfg = TrainConfig(strategy=strategy, checkpoint_dir=str(tmp_path / strategy), save_every=2, grace_s=10,
                      async_save=strategy in ("fsdp", "pp"), **BASE)
    args = to_flags(cfg, MODEL)
    # one SIGKILL needs one restart; one more absorbs torchrun's start-up port race (see injection.py)
    return points, run_with_faults(args, points, tmp_path / f"{strategy}.jsonl", max_restarts=3,
                                   shutdown_timeout=10, timeout_s=400)


# DDP and FSDP meet the same kills in the fault-tolerance lab (FSDP, async saves, under torchrun) and
# in tests/test_slurm.py (DDP on 2 nodes x 2 ranks, requeued); here the model-parallel strategies.
FAULTS = {"tp": [("SIGKILL", 0), ("SIGTERM", 1)], "pp": [("SIGTERM", 0), ("SIGKILL", 1)]}


def test_resume_is_bit_exact_after_kills_under_torchrun(tmp_path):
    """Tensor parallelism (DCP saves DTensor shards) and pipeline parallelism (each stage saves its own
    part, async) under torchrun --max-restarts 3, each hit by a SIGKILL and a SIGTERM at random steps,
    end bit-identical to uninterrupted runs. The jobs and the reference run at the same time: most of
    their time is interpreters starting. DDP and FSDP checkpoints of 2 ranks then resume in one process."""
    dp_runs = [TrainConfig(strategy=s, checkpoint_dir=str(tmp_path / s), async_save=s == "fsdp", **BASE)
               for s in ("ddp", "fsdp")]
    with ThreadPoolExecutor(len(FAULTS) + 1) as pool:
        pp_scratch = TrainConfig(strategy="pp_scratch", steps=STEPS, return_params=True)  # constant lr: see below
        ref = pool.submit(launch, train_many, [TrainConfig(strategy=s, return_params=True, **BASE)
                                               for s in FAULTS] + [pp_scratch] + dp_runs, MODEL, world_size=2)
        jobs = {s: pool.submit(_job, tmp_path, s, faults) for s, faults in FAULTS.items()}
        reference = {r["strategy"]: r for r in ref.result()[0][:len(FAULTS)]}
        for strategy, job in jobs.items():
            points, out = job.result()
            assert out["returncodes"] == [0], out["output_tail"]
            assert [f["step"] for f in out["fired"]] == [p.step for p in points], out["fired"]
            restores = [e["step"] for e in out["events"] if e["event"] == "restore"]
            preempted = [e for e in out["events"] if e["event"] == "preempted"]
            assert len(restores) == 3 and len(preempted) == 1 and preempted[0]["saved"]
            assert preempted[0]["step"] in restores  # SIGTERM: nothing lost, the run goes on from that step
            step, state = Checkpointer(tmp_path / strategy, readonly=True).load_latest()  # no group: whole tensors
            want = reference[strategy]["params"]
            assert step == STEPS and state["meta"]["world_size"] == 2
            assert set(state["model"]) == set(want), strategy  # a pipeline's stages merge into the whole GPT
            assert all(torch.equal(state["model"][k], want[k]) for k in want), f"{strategy}: kill points {points}"
            assert state["losses"] == reference[strategy]["loss"]
    # The hand-written pipeline saves each stage's part too: stopped half-way and started again, it
    # ends where the uninterrupted run ends (dropout's RNG and AdamW's moments restored; a constant
    # learning rate, since a run of half the steps has a cosine of its own).
    pp_ref = ref.result()[0][len(FAULTS)]
    half = replace(pp_scratch, steps=STEPS // 2, return_params=False, checkpoint_dir=str(tmp_path / "pps"),
                   save_every=2)
    launch(train, half, MODEL, world_size=2)
    resumed = launch(train, replace(half, steps=STEPS, return_params=True), MODEL, world_size=2)[0]
    assert resumed["start_step"] == STEPS // 2 and resumed["loss"] == pp_ref["loss"]
    assert all(torch.equal(resumed["params"][k], pp_ref["params"][k]) for k in pp_ref["params"])
    # The DDP checkpoint of 2 ranks resumes in one process: resharded, and it says so.
    more = train(TrainConfig(strategy="single", checkpoint_dir=str(tmp_path / "ddp"), **BASE | {"steps": STEPS + 1}),
                 MODEL)
    assert more["start_step"] == STEPS and more["restored"]["saved_world_size"] == 2
    assert "resharded from ddp x2 to single x1" in more["resume_notes"][0]
    # So does the FSDP one (DTensor shards gathered by DCP); its next step agrees with the DDP run's.
    fsdp_more = train(TrainConfig(strategy="single", checkpoint_dir=str(tmp_path / "fsdp"),
                                  **BASE | {"steps": STEPS + 1}), MODEL)
    assert fsdp_more["start_step"] == STEPS and fsdp_more["restored"]["saved_world_size"] == 2
    assert "resharded from fsdp x2 to single x1" in fsdp_more["resume_notes"][0]
    assert abs(fsdp_more["loss"][-1] - more["loss"][-1]) < 1e-5, (fsdp_more["loss"][-1], more["loss"][-1])
    # So do the tensor- and pipeline-parallel ones: TP's shards are contiguous blocks of a head-major QKV
    # matrix, and each stage's part (the tied head's optimizer state under the embedding's name) is read
    # by whichever rank needs it: one process holds exactly the weights the 2-rank run ended with.
    for s in ("tp", "pp"):
        r = train(TrainConfig(strategy="single", checkpoint_dir=str(tmp_path / s), return_params=True, **BASE),
                  MODEL)
        assert r["start_step"] == STEPS and f"resharded from {s} x2 to single x1" in r["resume_notes"][0]
        assert all(torch.equal(r["params"][k], v) for k, v in reference[s]["params"].items()), s


def test_the_soak_ten_kills_at_random_steps_end_bit_exact(tmp_path):
    """Issue 29's soak: ten SIGKILLs, each of a random rank at a random step (just after an async save
    was started, or a step later), in one run under torchrun --max-restarts 12; it ends
    bit-identical to an uninterrupted run, having restored ten times."""
    steps, kills = 24, 10
    rng = random.Random("soak")
    points = [Fault(step, "SIGKILL", rng.randint(0, 1)) for step in sorted(rng.sample(range(2, steps - 1), kills))]
    base = dict(BASE, steps=steps)
    cfg = TrainConfig(strategy="ddp", checkpoint_dir=str(tmp_path / "soak"), save_every=2, async_save=True, **base)
    with ThreadPoolExecutor(2) as pool:
        ref = pool.submit(launch, train, TrainConfig(strategy="ddp", return_params=True, **base), MODEL,
                          world_size=2)
        # a restart per kill, and two to absorb torchrun's start-up port race (see injection.py)
        out = run_with_faults(to_flags(cfg, MODEL), points, tmp_path / "soak.jsonl", max_restarts=kills + 2,
                              shutdown_timeout=10, timeout_s=500)
        reference = ref.result()[0]
    assert out["returncodes"] == [0], out["output_tail"]
    assert [f["step"] for f in out["fired"]] == [p.step for p in points], out["fired"]
    restores = [e["step"] for e in out["events"] if e["event"] == "restore"]
    # the start, then each kill: never behind the last, and from 0 again only before a save was published
    assert len(restores) >= kills + 1 and restores == sorted(restores) and restores[-1] > 0, restores
    step, state = Checkpointer(tmp_path / "soak", readonly=True).load_latest()
    assert step == steps and state["losses"] == reference["loss"], points
    assert all(torch.equal(state["model"][k], v) for k, v in reference["params"].items()), points


def test_what_cannot_be_resharded_is_refused_up_front():
    """DeepSpeed's own checkpoint format loads only into the strategy and world size that wrote it."""
    from labkit.fault_tolerance.resume import check_compatible

    run = {"seed": 0, "batch_size": 8, "model": {"n_layer": 2}}
    saved = {**run, "strategy": "zero3", "world_size": 2, "layout": "dp_shard=2", "reshardable": False}
    with pytest.raises(ValueError, match=r"a zero3 checkpoint \(dp_shard=2 ranks\) resumes only as it was saved"):
        check_compatible(saved, {**run, "strategy": "single", "world_size": 1, "layout": "single", "reshardable": True})
    assert check_compatible(saved, {**saved}) == []  # as it was saved: fine


def test_deepspeed_on_a_mesh_checkpoint_is_told_it_cannot_read_dcp():
    """Issue 43: zero2 on a mesh checkpoint was told the mesh checkpoint cannot reshard (it can: the
    run's DeepSpeed engine cannot read DCP's format)."""
    from labkit.fault_tolerance.resume import check_compatible

    run = {"seed": 0, "batch_size": 8, "model": {"n_layer": 2}}
    saved = {**run, "strategy": "mesh", "world_size": 2, "layout": "dp_shard=2", "reshardable": True}
    with pytest.raises(ValueError) as refused:
        check_compatible(saved, {**run, "strategy": "zero2", "world_size": 2, "layout": "dp_shard=2",
                                 "reshardable": False})
    assert str(refused.value) == ("strategy='zero2' cannot resume a mesh checkpoint: that one is in DCP's format, "
                                  "and DeepSpeed loads only checkpoints it saved itself; resume with a strategy that "
                                  "reads DCP ('mesh', 'fsdp', ...) or start zero2 in a new checkpoint_dir")


@pytest.mark.parametrize("key, saved, asked", [("weight_decay", 0.0, 0.1), ("warmup_steps", 2, 4), ("lr", 3e-3, 1e-3)])
def test_deepspeed_refuses_what_its_engine_would_restore_over_the_run(key, saved, asked):
    """DeepSpeed's engine loads its optimizer's hyperparameters and its schedule itself: a change there
    would be lost silently, so it is refused before the engine loads, naming the setting."""
    from labkit.fault_tolerance.resume import check_engine

    check_engine({key: saved}, {key: saved})
    with pytest.raises(ValueError, match=f"^{key}={asked!r} differs from the checkpoint's {saved!r}, and DeepSpeed "
                                         f"restores its own optimizer and schedule: resume with {key}={saved!r}"):
        check_engine({key: saved}, {key: asked})
    check_engine({}, {key: asked})  # a checkpoint that did not record it resumes as before


def test_deepspeed_checkpoints_go_through_the_same_checkpointer(tmp_path):
    """ZeRO-3 saves with engine.save_checkpoint into the atomic, checksummed layout; a planted pickle
    in its optimizer file (DeepSpeed loads with weights_only=False) is refused before DeepSpeed sees it,
    also when it sits behind a symbolic link the pickle scan would not enter, and the resume from the
    step before is bit-exact; a changed weight decay, which the engine would load over, is refused."""
    out = launch(deepspeed_resume, "zero3", str(tmp_path / "ck"), str(tmp_path / "pwned"), world_size=2,
                 quiet=True)[0]
    assert out["start_step"] == 2 and "skipped step 6: refused to load" in out["notes"][0]
    assert "skipped step 4: engine/ckpt: a symbolic link" in out["notes"][1]
    assert out["bit_exact"] and out["loss_equal"] and not (tmp_path / "pwned").exists()
    assert out["refused"].startswith("weight_decay=0.1 differs from the checkpoint's 0.0, and DeepSpeed restores")


def test_checkpoint_benchmark_measures_a_restorable_state(tmp_path):
    from labkit.fault_tolerance.bench import measure

    cfg = GPTConfig(block_size=16)
    r = measure(cfg, tmp_path, repeats=1)
    assert r["restored_identical"]
    # parameters and AdamW's two moments in fp32 (12 bytes a parameter; the tied embedding and head are
    # two names of one matrix, stored twice), small metadata files, and no gradients (16 bytes)
    assert 12 * GPT.count_params(cfg) < r["state_gb"] * 1e9 < 16 * GPT.count_params(cfg)
    b = r["bench"]
    assert b["async"]["blocking_s"] < b["async"]["total_s"] and b["sync"]["hash_s"] < b["sync"]["total_s"]
    assert set(r["hash_gbps"]) == {"xxh3_64", "crc32", "sha256"}
    with pytest.raises(ValueError, match="repeats must be a positive integer, got 0"):
        measure(GPTConfig(block_size=16), tmp_path, repeats=0)


def test_checkpoints_work_without_xxhash_on_a_bare_gpu_image(tmp_path):
    """Issue 27, item 5: xxhash was imported at module level, so where it is absent (the GPU image)
    the determinism item and the fault-tolerance lab were lost. Without it the default is CRC-32."""
    code = (
        "import sys; sys.modules['xxhash'] = None\n"
        "import torch\n"
        "from labkit.fault_tolerance.files import DEFAULT_HASH, available_hashes, file_digest\n"
        "from labkit.fault_tolerance import Checkpointer\n"
        "assert DEFAULT_HASH == 'crc32' and available_hashes() == ('crc32', 'sha256'), available_hashes()\n"
        f"ck = Checkpointer({str(tmp_path)!r})\n"
        "ck.save(3, {'w': torch.arange(4.0), 'step': 3})\n"
        "step, state = ck.load_latest()\n"
        "print(ck.hash, step, state['w'].tolist())\n"
        "try:\n"
        "    file_digest(sys.executable, 'xxh3_64')\n"
        "except ModuleNotFoundError as e:\n"
        "    print('missing', e.name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["crc32 3 [0.0, 1.0, 2.0, 3.0]", "missing xxhash"], proc.stdout
