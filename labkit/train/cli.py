"""``python -m labkit.train``: the training loop from a shell, under torchrun, DeepSpeed's launcher or srun.

    python -m labkit.train --strategy fsdp --steps 20                 # one process (a one-rank group)
    torchrun --nproc-per-node 2 -m labkit.train --strategy ddp --steps 20 --metrics out.json

Every flag is a :class:`~labkit.train.config.TrainConfig` or :class:`~labkit.core.model.GPTConfig`
field, grouped as ``--help`` shows. A bad value ends the run with one line, ``error: ...``, and exit
status 2, on every rank, before training starts; a run that finishes exits 0, one preempted 75
(``LABKIT_PREEMPTED_EXIT_CODE`` sets another: ``python -m labkit.launch.torchrun`` sets 0, because
torchrun counts any other status as a failure and restarts the ranks under ``--max-restarts``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, fields
from pathlib import Path

from labkit.core.checks import existing_file, output_dir, output_file
from labkit.core.cli import ArgumentParser
from labkit.core.model import GPTConfig
from labkit.fault_tolerance.errors import CheckpointError
from labkit.fault_tolerance.preemption import REQUEUE_EXIT_CODE
from labkit.train.config import GROUPS, TrainConfig
from labkit.train.strategies import STRATEGIES, layout

MODEL_HELP = {
    "vocab_size": "tokens in the vocabulary (256: every byte is a token)",
    "block_size": "context length in tokens (the sequence length every row has)",
    "n_layer": "transformer blocks",
    "n_head": "attention heads per block (must divide --n-embd)",
    "n_embd": "hidden size (width of the residual stream)",
    "dropout": "dropout probability in [0, 1)",
    "bias": "biases in the linear layers and LayerNorms",
    "moe_experts": "experts per mixture-of-experts MLP (0: the dense MLP)",
    "moe_top_k": "experts each token is routed to",
    "moe_capacity_factor": "expert capacity = ceil(factor x top_k x tokens / experts) token-choices; 0: no limit",
    "moe_aux_weight": "weight of each MoE block's load-balancing loss (Switch Transformer: 0.01)",
    "moe_expert_ffn": "each expert's hidden width (0: 4 x n_embd; fine-grained experts are narrower)",
    "moe_shared": "shared experts, run on every token without routing (DeepSeekMoE)",
    "moe_bias_rate": "auxiliary-loss-free balancing: the routing bias's update speed per step (0: off)",
    "moe_groups": "node-limited routing: experts in this many groups, as nodes hold them (0: off)",
    "moe_group_limit": "node-limited routing: each token to experts of at most this many groups",
}
NOT_FLAGS = ("return_params",)  # fields a notebook sets and a command line has no use for: no flag


# Flags that were renamed: one line saying what each became (issue 47: one vocabulary for a layout)
RENAMED = {"--schedule": "--pp-schedule", "--replicas": "--dp-replicate"}


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {RENAMED[option_string]}")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:  # no "(default: None)" noise
        return action.help if action.default in (None, argparse.SUPPRESS) else super()._get_help_string(action)


def _describe_strategies() -> str:
    rows = [f"  {s.name:14} {s.summary}" + (" [teaching]" if s.teaching else "") + f"\n  {'':14} = {layout(s)}"
            for s in STRATEGIES.values()]
    return ("strategies: each name, then the degrees it is (-1: the ranks the other degrees leave)\n"
            + "\n".join(rows))


def _kind(f, default) -> dict:
    choices = f.metadata.get("choices")
    if choices:
        return {"choices": choices}
    if isinstance(default, bool) or f.type in ("bool | None",):
        return {"action": argparse.BooleanOptionalAction}
    return {"type": str if default is None else type(default)}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m labkit.train", formatter_class=_Formatter,
                                description="Train the lab GPT with a parallel strategy; run it under torchrun "
                                            "for several ranks.", epilog=_describe_strategies())
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    for f in fields(TrainConfig):
        if f.name in NOT_FLAGS:
            continue
        names = ["--" + f.name.replace("_", "-")]
        kind = _kind(f, f.default)
        if f.name == "strategy":
            kind = {"choices": ["auto", *STRATEGIES]}
        groups[f.metadata["group"]].add_argument(*names, dest=f.name, default=f.default, help=f.metadata["help"],
                                                 **kind)
    model = p.add_argument_group("model (GPTConfig)")
    for f in fields(GPTConfig):
        model.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=MODEL_HELP[f.name],
                           **_kind(f, f.default))
    data = groups["data and optimisation"]
    data.add_argument("--corpus", default=None, help="text file to train on, read as bytes (default: the shipped "
                      "tiny Shakespeare)")
    out = groups["output"]
    out.add_argument("--metrics", default=None, help="write the run's metrics JSON here (rank 0)")
    p.add_argument("--list-strategies", action="store_true", help="describe every strategy and exit")
    p.add_argument("--can-checkpoint", action="store_true", help="print 'yes' when --strategy can save and resume, "
                   "else 'no: <why>', and exit (for batch scripts)")
    for old in RENAMED:
        p.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)
    # The `deepspeed` launcher passes --local_rank; the rank is read from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def flags_from(values: dict) -> list[str]:
    """Command-line flags for the ``TrainConfig`` and ``GPTConfig`` fields among ``values`` (other keys,
    and values that are not plain numbers, strings or booleans, are left out)."""
    known = {f.name for f in (*fields(TrainConfig), *fields(GPTConfig))} - set(NOT_FLAGS)
    out: list[str] = []
    for k, v in values.items():
        if k not in known or v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, (int, float, str)):
            out += [flag, str(v)]
    return out


def to_flags(cfg: TrainConfig, model_cfg: GPTConfig | None = None) -> list[str]:
    """The flags of ``python -m labkit.train`` that make the run ``cfg`` (on ``model_cfg``): every field
    that differs from its default."""
    changed = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig) if getattr(cfg, f.name) != f.default}
    if model_cfg is not None:
        changed |= {f.name: getattr(model_cfg, f.name) for f in fields(GPTConfig)
                    if getattr(model_cfg, f.name) != f.default}
    return flags_from(changed)


def _configs(parser: argparse.ArgumentParser, args: dict) -> tuple[TrainConfig, GPTConfig]:
    try:
        tc = TrainConfig(**{f.name: args[f.name] for f in fields(TrainConfig) if f.name in args})
        mc = GPTConfig(**{f.name: args[f.name] for f in fields(GPTConfig)})
        if args["corpus"] is not None and not existing_file("corpus", args["corpus"]):
            raise ValueError(f"corpus={args['corpus']!r} is not a file; pass the path of a text file, or leave "
                             "--corpus out for the shipped corpus")
        for name, directory in (("checkpoint_dir", tc.checkpoint_dir), ("step_log", tc.step_log and
                                 Path(tc.step_log).parent), ("metrics", args["metrics"] and Path(args["metrics"]).parent),
                                ("profile_dir", tc.profile_steps and tc.profile_dir),
                                ("memory_snapshot", tc.memory_snapshot and Path(tc.memory_snapshot).parent)):
            if directory:  # unset (None, or the empty setting the flags' own checks refuse)
                output_dir(name, directory)
        for name, path in (("metrics", args["metrics"]), ("step_log", tc.step_log)):
            if path is not None:
                output_file(name, path)
    except ValueError as e:
        parser.error(as_flags(str(e)))  # exits 2 with the message, as for any other bad flag
    return tc, mc


def configs_from(argv: list[str]) -> tuple[TrainConfig, GPTConfig]:
    """The run a ``python -m labkit.train`` command line describes, to launch it from a notebook as it
    was printed (a bad flag: argparse's error, exit status 2, as on the command line)."""
    parser = build_parser()
    return _configs(parser, vars(parser.parse_args(argv)))


def as_flags(message: str) -> str:
    """A config error in the command line's words: ``batch_size must...`` -> ``--batch-size must...``."""
    known = {f.name for f in (*fields(TrainConfig), *fields(GPTConfig))} | {"corpus", "metrics"}

    def flag(m: re.Match) -> str:
        return "--" + m.group(2).replace("_", "-") if m.group(2) in known else m.group(0)

    return re.sub(r"\b(GPTConfig\.)?([a-z][a-z0-9_]*)\b(?==| must| has no effect| is not|: )", flag, message)


def main(argv: list[str] | None = None) -> int:
    from labkit.launch import init_from_env, init_one_rank, leave_group
    from labkit.train.loop import train
    from labkit.train.strategies import strategy

    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args["list_strategies"]:
        print(_describe_strategies())
        return 0
    tc, mc = _configs(parser, args)
    if args["can_checkpoint"]:
        why = strategy(tc.strategy).cannot_checkpoint
        print("yes" if why is None else f"no: {why}")
        return 0
    if tc.deterministic:  # cuBLAS reads it once, when the process first uses it: before CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        from labkit.core.devices import torchrun_env
        from labkit.train.feasible import check_fits

        ranks = torchrun_env() if "RANK" in os.environ else (0, 1, 0, 1)  # a bad variable: one line, below
        check_fits(tc, mc, ranks[1], ranks[3] or ranks[1])  # an impossible model: refused before it starts
        if "RANK" in os.environ:
            rank, world, _ = init_from_env(tc.device)
        elif strategy(tc.strategy).needs_group:
            init_one_rank(tc.device)
            rank, world = 0, 1
        else:
            rank, world, _ = init_from_env(tc.device)
        result = train(tc, mc, corpus=args["corpus"])
    except (ValueError, CheckpointError) as e:  # what this run cannot do: the same one line on every rank
        leave_group(clean=False)
        parser.error(as_flags(str(e)))
    except BaseException:
        leave_group(clean=False)
        raise
    leave_group()
    preempted = result["preempted"]
    code = _preempted_exit_code() if preempted else 0
    if rank == 0:
        print(f"{tc.strategy} on {world} rank(s): steps {result['start_step']}..{len(result['loss'])}, loss "
              f"{result['loss'][0]:.4f} -> {result['loss'][-1]:.4f} in {sum(result['step_time_s']):.2f} s"
              + (f"; preempted by {preempted['signal']} at step {preempted['step']}, "
                 f"{'checkpoint saved' if preempted['saved'] else 'no time to save'}, exiting {code} to be requeued"
                 if preempted else ""))
        if args["metrics"]:
            out = Path(args["metrics"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"config": asdict(tc), **result}, indent=1))
            print(f"metrics written to {out}")
    return code


def _preempted_exit_code() -> int:
    """75 (EX_TEMPFAIL), or ``LABKIT_PREEMPTED_EXIT_CODE`` when it is an exit status (0 to 255)."""
    value = os.environ.get("LABKIT_PREEMPTED_EXIT_CODE", "")
    return int(value) if re.fullmatch(r"[0-9]{1,3}", value) and int(value) <= 255 else REQUEUE_EXIT_CODE
