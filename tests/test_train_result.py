"""train() returns what labkit.train.result declares: no undeclared key, every Required key, each value
of its declared type, and every declared key returned by some run (or named below as out of reach)."""
import signal
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints, is_typeddict

import pytest
import torch

from labkit.core.model import GPTConfig
from labkit.fault_tolerance.preemption import PreemptionHandler
from labkit.train import RankFigures, TrainConfig, TrainResult, train

MODEL = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
MOE = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, moe_experts=4)
BASE = dict(steps=2, batch_size=2, progress=False)
# what the checker cannot check (values typed Any), by path: it checks all else
UNCHECKED = {"result.model[]"}
# keys only multi-rank runs return (cp, ep and HSDP need a process group of several ranks), and
# `events`, which train() deletes from every rank's figures once it has read them
OUT_OF_REACH = {"cp", "kv_formula_bytes_per_step", "ep", "replicas", "shard_group", "comm_formula",
                "ranks[].kv_bytes_per_step", "ranks[].all_to_all_bytes_per_step", "ranks[].events"}


def problems(value: Any, tp: Any, where: str, unchecked: set[str]) -> list[str]:
    """Where ``value`` is not of type ``tp`` (empty when it is); adds to ``unchecked`` where it cannot tell."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is None or tp is type(None):
        return [] if value is None else [f"{where}: {value!r} is not None"]
    if origin in (types.UnionType, typing.Union):
        found = [problems(value, a, where, unchecked) for a in args]
        return [] if any(not p for p in found) else [p for ps in found for p in ps]
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__} is not a {tp.__name__}"]
        hints = get_type_hints(tp)
        out = [f"{where}.{k}: not declared in {tp.__name__}" for k in set(value) - set(hints)]
        out += [f"{where}.{k}: required by {tp.__name__}, missing" for k in tp.__required_keys__ - set(value)]
        return out + [p for k, v in value.items() if k in hints for p in problems(v, hints[k], f"{where}.{k}", unchecked)]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__} is not a list"]
        return [p for v in value for p in problems(v, args[0], f"{where}[]", unchecked)]
    if origin is tuple:
        if not isinstance(value, tuple) or len(value) != len(args):
            return [f"{where}: {value!r} is not a {len(args)}-tuple"]
        return [p for v, a in zip(value, args) for p in problems(v, a, f"{where}[]", unchecked)]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__} is not a dict"]
        return [p for k, v in value.items()
                for p in problems(k, args[0], f"{where}[key]", unchecked) + problems(v, args[1], f"{where}[]", unchecked)]
    if tp is float:  # the numeric tower: an int is a float (sum([]) is 0)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp in (str, bool) or tp is torch.Tensor:
        ok = isinstance(value, tp)
    else:  # Any, Literal, a class: not checked, but said
        unchecked.add(where)
        return []
    return [] if ok else [f"{where}: {value!r} is not a {tp.__name__}"]


def _preempt_at_once(handler: PreemptionHandler) -> PreemptionHandler:
    """PreemptionHandler.install, then SIGUSR1 to this process: the run stops after its first step."""
    out = _install(handler)
    signal.raise_signal(signal.SIGUSR1)
    return out


_install = PreemptionHandler.install


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, TrainResult]:
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    out = {"moe_params": train(TrainConfig(strategy="single", return_params=True, **BASE), MOE),
           "tp": train(TrainConfig(strategy="tp", **BASE), MODEL),
           "pipeline": train(TrainConfig(strategy="pp_scratch", microbatches=2, **BASE), MODEL)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PreemptionHandler, "install", _preempt_at_once)
        out["preempted"] = train(TrainConfig(strategy="single", checkpoint_dir=ckpt, **BASE), MODEL)
    out["resumed"] = train(TrainConfig(strategy="single", checkpoint_dir=ckpt, **BASE), MODEL)
    out["nothing_left"] = train(TrainConfig(strategy="single", checkpoint_dir=ckpt, **BASE), MODEL)
    return out


def test_the_declarations_resolve():
    for td in (TrainResult, RankFigures):
        assert td.__required_keys__ | td.__optional_keys__ == set(get_type_hints(td))  # every name resolves


@pytest.mark.parametrize("name", ["moe_params", "tp", "pipeline", "preempted", "resumed", "nothing_left"])
def test_a_run_returns_only_declared_keys_of_their_declared_types(runs, name):
    r, unchecked = runs[name], set()
    assert set(r) <= set(get_type_hints(TrainResult)), set(r) - set(get_type_hints(TrainResult))
    assert TrainResult.__required_keys__ <= set(r), TrainResult.__required_keys__ - set(r)
    found = problems(r, TrainResult, "result", unchecked)
    assert not found, "\n".join(found)
    assert unchecked == UNCHECKED


def test_the_runs_reach_what_they_should(runs):
    assert runs["preempted"]["preempted"]["signal"] == "SIGUSR1" and runs["preempted"]["preempted"]["step"] == 1
    assert runs["preempted"]["checkpoints"][0]["step"] == 1
    assert runs["resumed"]["restored"]["step"] == 1 and len(runs["resumed"]["loss"]) == 2
    assert runs["nothing_left"]["start_step"] == 2 and runs["nothing_left"]["step_time_s"] == []
    assert "median_step_s" not in runs["nothing_left"]  # no step timed: the speed keys it can leave out
    assert runs["nothing_left"]["ranks"][0]["model_state_bytes"] is None
    assert runs["moe_params"]["ranks"][0]["routing_per_step"]


def test_every_declared_key_is_returned_by_some_run(runs):
    returned = {k for r in runs.values() for k in r}
    returned |= {f"ranks[].{k}" for r in runs.values() for rank in r["ranks"] for k in rank}
    declared = set(get_type_hints(TrainResult)) | {f"ranks[].{k}" for k in get_type_hints(RankFigures)}
    assert declared - returned == OUT_OF_REACH
