"""Every command line: a bad argument is one line naming it, and exit status 2; --help explains every flag."""
import argparse
import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from labkit.core.model import GPTConfig
from labkit.labs.cli import main as labs_main
from labkit.planning.__main__ import main as planning_main
from labkit.planning.layouts_cli import main as plan_main
from labkit.planning.memory_cli import main as memory_main
from labkit.train.cli import build_parser, main as train_main
from labkit.train.config import GROUPS, TrainConfig

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
# One bad value per flag of `python -m labkit.train` (booleans take no value: given one, argparse refuses)
BAD = {"strategy": "nosuch", "device": "tpu", "bucket_cap_mb": "0", "reshard_after_forward": "=1",
       "cpu_offload": "=1", "fsdp_bf16": "=yes", "offload_optimizer": "=1", "tp": "-2", "sequence_parallel": "=1",
       "pp": "x", "microbatches": "0", "pp_schedule": "zb", "steps": "0", "batch_size": "-8", "grad_accum": "0",
       "lr": "-1", "weight_decay": "-0.1", "grad_clip": "nan", "lr_schedule": "linear", "warmup_steps": "-2",
       "seed": "-1", "precision": "fp4", "activation_checkpointing": "every:0", "checkpoint_dir": "/proc/nosuch",
       "save_every": "-5", "keep_last": "0", "async_save": "=1", "resume": "=0", "grace_s": "-30",
       "reserve_s": "-1", "step_log": "/proc/nosuch/log.jsonl", "progress": "=1", "vocab_size": "0",
       "block_size": "0", "n_layer": "-1", "n_head": "3", "n_embd": "0", "dropout": "1.5", "bias": "=0",
       "corpus": "/no/such/file", "metrics": None, "count_comm": "sometimes", "peak_tflops": "-1",
       "profile_steps": "1:5", "profile_dir": ["--profile-steps", "0:1", "--profile-dir", "/proc/nosuch"],
       "tf32": [], "deterministic": "=1", "memory_snapshot": "snap", "restart_if_unusable": "=1",
       "sync_each_microbatch": "=1", "link_gbps": "-1", "link_latency_ms": "-1", "input_delay_ms": "-5", "cp": "-3",
       "ep": "-2", "dp_replicate": "0", "dp_shard": "-2", "moe_experts": "-1", "moe_top_k": "0", "moe_capacity_factor": "-1", "moe_aux_weight": "-0.5",
       "moe_expert_ffn": "-1", "moe_shared": "-1", "moe_bias_rate": "-0.1", "moe_groups": "-1", "moe_group_limit": "-1",
       "pp_stages_per_rank": "-2", "pp_first_stage_less_layers": "x", "pp_last_stage_less_layers": "-1"}  # tf32, memory_snapshot: CUDA only


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _one_line_error(capsys, run, argv) -> str:
    with pytest.raises(SystemExit) as e:
        run(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and ": error: " in err and "Traceback" not in err, (argv, err)
    return err


def test_the_table_of_bad_values_covers_every_flag():
    flags = {f.name for f in (*fields(TrainConfig), *fields(GPTConfig))} - {"return_params"} | {"corpus", "metrics"}
    assert set(BAD) == flags


@pytest.mark.parametrize("name", [n for n, v in BAD.items() if v is not None])
def test_every_train_flag_with_a_bad_value_is_one_line_and_exit_2(capsys, name):
    value = BAD[name]
    if isinstance(value, list):  # a flag alone, or a flag that is bad together with another
        argv = ["--steps", "1", *(value or [_flag(name)])]
    else:
        argv = ["--steps", "1", _flag(name) + value] if value.startswith("=") else ["--steps", "1", _flag(name), value]
    if name == "steps":
        argv = [_flag(name), value]
    err = _one_line_error(capsys, train_main, argv)
    assert _flag(name) in err or "argument" in err, err  # it names the flag
    assert "Traceback" not in err


# Values a person types by accident: a superscript digit (str.isdigit says yes, int() says no), an
# empty file where a corpus should be.
@pytest.mark.parametrize("flag, value, words", [
    ("--activation-checkpointing", "every:²", "must be a positive integer"),
    ("--corpus", "EMPTY", "holds 0 bytes; it needs at least 2 (an empty file?)"),
    ("--schedule", "1f1b", "is now --pp-schedule"),  # an old name says what it became (issue 47)
    ("--replicas", "2", "is now --dp-replicate"),  # hsdp's replicas are the mesh's dp_replicate (issue 47)
])
def test_values_typed_by_accident_are_named(capsys, tmp_path, flag, value, words):
    if value == "EMPTY":
        (tmp_path / "empty.txt").touch()
        value = str(tmp_path / "empty.txt")
    err = _one_line_error(capsys, train_main, ["--steps", "1", flag, value])
    assert flag in err and words in err, err


def test_every_train_flag_has_help_in_a_group():
    p = build_parser()
    titles = {g.title for g in p._action_groups}
    assert set(GROUPS) | {"model (GPTConfig)"} <= titles
    for action in p._actions:
        if action.dest in ("help", "local_rank") or action.help == argparse.SUPPRESS:
            continue
        assert action.help and len(action.help) > 15, action.dest
    text = p.format_help()
    assert "strategies:" in text and "tp_scratch" in text and "[teaching]" in text


@pytest.mark.parametrize("argv", [["--devices", "0"], ["--micro-batch", "-1"], ["--seq-len", "0"], ["--mfu", "2"],
                                  ["--tokens", "-1"], ["--preemptions-per-day", "0"], ["--model", "gpt9"], ["--hfu", "2"],
                                  ["--mfu", "0.4", "--hfu", "0.5"],
                                  ["--device-type", "tpu"], ["--precision", "fp8"], ["--recompute", "half"]])
def test_memory_cli_bad_values_are_one_line_before_any_output(capsys, argv):
    _one_line_error(capsys, memory_main, argv)
    assert capsys.readouterr().out == ""  # no half-printed table


_HUGE = str(10**300)


@pytest.mark.parametrize("argv, words", [
    (["--hidden", _HUGE, "--layers", "2", "--heads", "2"], "--hidden=1000... (301 digits) is too large"),
    (["--devices", _HUGE], "world_size must be at most 1e+15"),
    (["--model", "DEEP"], "nested too deeply"),
    (["--model", "HUGE"], "hidden_size must be between 0 and 1e+15"),
])
def test_memory_cli_huge_and_hostile_inputs_are_one_line(capsys, tmp_path, argv, words):
    """What ended in OverflowError and RecursionError tracebacks (issue 29, item 9)."""
    (tmp_path / "DEEP.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    (tmp_path / "HUGE.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 10**300, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 8, "vocab_size": 10, "max_position_embeddings": 16}))
    argv = [str(tmp_path / f"{a}.json") if a in ("DEEP", "HUGE") else a for a in argv]
    assert words in _one_line_error(capsys, memory_main, argv)


@pytest.mark.parametrize("main", [memory_main, plan_main], ids=["planning memory", "planning layouts"])
@pytest.mark.parametrize("argv, words", [
    (["--hidden", "2147483648"], "--hidden=2147483648 is too large"),  # a traceback in the planner's search
    (["--vocab", "0"], "--vocab must be a positive integer, got 0"),  # the planner took 0 as the default
    (["--experts", "8", "--experts-per-token", "0"], "--experts-per-token must be a positive integer, got 0"),
    (["--layers", "100000"], "--layers=100000 is too large"),  # 10,000 layers took the search minutes
    (["--hidden", "1000000", "--layers", "1000", "--heads", "1000"], "holds 1.2e+16 parameters; valid: at most 1e+15"),
], ids=["hidden 2^31", "vocab 0", "experts-per-token 0", "layers 1e5", "each within bounds, the product not"])
def test_model_shape_flags_are_bounded_in_one_line(capsys, main, argv, words):
    """Issue 43, item 11: every shape flag at least 1 and at most a bound past any model trained."""
    argv = {"--hidden": "64", "--layers": "2", "--heads": "2"} | dict(zip(argv[::2], argv[1::2]))
    assert words in _one_line_error(capsys, main, [x for kv in argv.items() for x in kv])


@pytest.mark.parametrize("argv", [[], ["--model", "llama3-8b"], ["--devices", "8", "memory"], ["plan"], ["-h", "memory"]],
                         ids=["nothing", "flags only", "flags first", "no such subcommand", "help and more"])
def test_the_planner_without_a_subcommand_names_both_in_one_line(capsys, argv):
    """``python -m labkit.planning`` takes a subcommand first, git-style: without one, one line naming
    both, exit status 2, nothing on stdout."""
    assert planning_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "error: " in err and "memory or layouts" in err and "Traceback" not in err, err


def test_the_planner_names_each_subcommand_in_one_line_of_help():
    proc = subprocess.run([sys.executable, "-m", "labkit.planning", "--help"], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert [r[0] for r in rows] == ["memory", "layouts"] and all(len(r) > 4 for r in rows), proc.stdout
    no_subcommand = subprocess.run([sys.executable, "-m", "labkit.planning"], capture_output=True, text=True,
                                   env=ENV, timeout=120)
    assert no_subcommand.returncode == 2 and no_subcommand.stdout == "", no_subcommand.stdout
    assert len(no_subcommand.stderr.splitlines()) == 1 and "memory or layouts" in no_subcommand.stderr


@pytest.mark.parametrize("sub, flag", [("memory", "--micro-batch"), ("layouts", "--global-batch")])
def test_each_planner_subcommand_has_its_own_help(capsys, sub, flag):
    with pytest.raises(SystemExit) as e:
        planning_main([sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m labkit.planning {sub} ") and flag in out, out[:300]


def test_each_planner_subcommand_runs_its_command_and_refuses_in_its_name(capsys):
    assert planning_main(["memory", "--model", "llama2-70b", "--devices", "8"]) == 0
    assert "68.98 B parameters" in capsys.readouterr().out
    assert "python -m labkit.planning layouts: error: --top" in _one_line_error(capsys, planning_main,
                                                                                ["layouts", "--top", "0"])


def test_python_m_labkit_memory_names_the_command_it_became():
    """The memory package no longer runs the planner, which sits above it (.importlinter's layers hold
    that with no exception): one line naming the new command, exit status 2."""
    proc = subprocess.run([sys.executable, "-m", "labkit.memory", "--model", "llama2-70b"], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and "python -m labkit.planning memory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["run", "nosuch"], ["run", "data_parallel", "--profile", "huge"],
                                  ["flags", "data_parallel", "gpu", "--world-size", "0"], ["flags", "x", "gpu",
                                                                                            "--world-size", "2"],
                                  ["bogus"], ["run", "data_parallel", "-p", "steps", "-5"],
                                  ["run", "data_parallel", "-p", "steps=2.5"], ["run", "data_parallel", "-p", "steps"],
                                  ["run", "data_parallel", "--profile", "gpu", "--gpus", "4096"]])
def test_lab_runner_bad_values_are_one_line(capsys, argv):
    _one_line_error(capsys, labs_main, argv)


@pytest.mark.parametrize("argv, words", [
    (["run", "data_parallel", "--out", ""], "--out='' is empty"),  # was the working directory
    (["run", "x" * 5000], "(5000 characters) does not exist"),  # was OSError: File name too long
    (["resolve", "x" * 5000, "ci"], "(5000 characters) has no profiles"),
    (["run", "data_parallel", "-p", "ring_world_sizes=[0, 2]"], "OVERRIDES['ring_world_sizes'][0]=0 must be above 0"),
    (["run", "data_parallel", "-p", "ring_world_sizes", '[2, "x"]'], "[1]='x' must be a whole number"),
    (["run", "data_parallel", "-p", "ring_world_sizes=[2.5]"], "['ring_world_sizes'][0]=2.5 must be a whole number"),
    (["run", "data_parallel", "-p", "ring_world_sizes=[]"], "['ring_world_sizes']=[] must hold at least one item"),
    (["run", "memory", "-p", "sizes=[[2, 64]]"], "OVERRIDES['sizes'][0]=[2, 64] must hold 3 items"),
    (["run", "activation_checkpointing", "-p", "policies=[1]"], "OVERRIDES['policies'][0]=1 must be a string"),
    (["run", "composing", "-p", 'layout_3d={"tp": 2}'], "OVERRIDES['layout_3d'] must have the keys"),
    # issue 44, item 6: a parameter the lab does not read, and a choice that does not exist
    (["run", "composing", "-p", "world_size=3"], "unknown keys ['world_size']; valid keys: ['batch_size'"),
    (["run", "composing", "-p", "precision=fp9"], "'fp9' is not one of ['fp32', 'bf16', 'fp16'"),
    (["run", "inside_device", "-p", 'fp8_precisions=["fp32", "fp7"]'], "'fp7' is not one of"),
    (["run", "activation_checkpointing", "-p", 'policies=["every:x"]'], "k in 'every:k' must be a positive"),
    (["run", "communication", "-p", 'ops=["all_reduce", "allreduce"]'], "'allreduce' is not one of"),
    (["run", "pipeline_parallel", "-p", "plan_model=gpt5"], "'gpt5' is not one of"),
    (["profiles", "nosuch"], "does not exist"),
], ids=["--out empty", "a 5,000-character lab", "resolve a 5,000-character lab", "a list item 0",
        "a list item a word", "a list item a fraction", "an empty list", "a triple of two", "a list item not a string",
        "a mapping short of keys", "a parameter the lab does not read", "a precision", "an fp8 precision",
        "a recompute policy", "a collective", "a model", "profiles of no lab"])
def test_lab_runner_refuses_in_one_line_before_any_lab_runs(capsys, monkeypatch, tmp_path, argv, words):
    """Issue 43, item 11: checked before papermill starts a kernel, and nothing written where it runs."""
    import labkit.labs.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "run_labs", lambda *a, **kw: pytest.fail(f"a lab ran: {a} {kw}"))
    assert words in _one_line_error(capsys, labs_main, argv)
    assert not list(tmp_path.iterdir())


def test_profiles_of_a_lab_print_as_a_table_and_a_run_says_what_it_changed(capsys, monkeypatch, tmp_path):
    import labkit.labs.runner as runner

    assert labs_main(["profiles", "memory"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "memory:" and [c.strip() for c in table[1].split("|")[1:-1]] == ["parameter", "cpu", "ci", "gpu"]
    assert any(line.startswith("| mp_steps ") for line in table)

    def fake(name, src, out_nb, parameters):  # the lab as papermill would leave it: its metrics written
        (out_nb.parent / parameters["METRICS_PATH"]).write_text("{}")
        out_nb.write_text("{}")

    monkeypatch.setattr(runner, "_execute_notebook", fake)
    assert labs_main(["run", "memory", "--profile", "ci", "-p", "mp_steps=3", "--out", str(tmp_path)]) == 0
    assert "executing with PROFILE='ci', mp_steps=3 (the profile's: 16)" in capsys.readouterr().out


def test_can_checkpoint_asks_the_registry(capsys):
    assert train_main(["--strategy", "fsdp", "--can-checkpoint"]) == 0
    assert capsys.readouterr().out.strip() == "yes"
    assert train_main(["--strategy", "tp_scratch", "--can-checkpoint"]) == 0
    assert capsys.readouterr().out.startswith("no: its shards are plain tensors")


def test_fsdp_without_torchrun_runs_in_a_one_rank_group(tmp_path):
    """What used to die with AttributeError ('GPT' object has no attribute 'set_requires_gradient_sync')."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "labkit.train", "--strategy", "fsdp", "--steps", "2",
                           "--block-size", "16", "--metrics", str(out)], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    m = json.loads(out.read_text())
    assert m["strategy"] == "fsdp" and m["world_size"] == 1 and len(m["loss"]) == 2


@pytest.mark.parametrize("env, argv, words", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, [], "WORLD_SIZE='abc' must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, [], "LOCAL_RANK='x' must be a whole number"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, [], "RANK=5 is outside WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, ["--max-bytes", "100000G"], "GiB available; give a smaller --max-bytes"),
])
def test_comm_bench_checks_torchruns_variables_and_its_buffers_first(capsys, monkeypatch, env, argv, words):
    """What read LOCAL_RANK raw and went to the allocator with 100000G (issue 29, item 9)."""
    from labkit.comm.bench import main as bench_main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert words in _one_line_error(capsys, bench_main, argv)
