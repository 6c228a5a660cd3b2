"""A named strategy is a name for degrees (issue 47): ``--strategy X`` and the degrees it expands to,
given by hand to the mesh, train bit for bit alike, and the presets that are not such names (their
data parallelism is another implementation) are the ones the registry says they are."""
from __future__ import annotations

from dataclasses import replace

import pytest

from mesh_fns import runs
from labkit.core.model import GPTConfig
from labkit.launch import launch
from labkit.parallel.layout.mesh import Degrees
from labkit.train import TrainConfig
from labkit.train.validate import degrees_for
from labkit.train.strategies import STRATEGIES

MODEL = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)
MOE = replace(MODEL, moe_experts=4, moe_top_k=2)
WORLD, STEPS = 4, 3
BASE = TrainConfig(steps=STEPS, batch_size=8, lr=3e-3, count_comm="none")
# preset -> (its flags, the same layout as mesh degrees, the model)
PRESETS = {"fsdp": (dict(), dict(dp_shard=4), MODEL),
           "hsdp": (dict(dp_replicate=2), dict(dp_replicate=2, dp_shard=2), MODEL),
           "tp": (dict(tp=2), dict(tp=2, dp_shard=2), MODEL),
           "pp": (dict(pp=2, microbatches=2), dict(pp=2, dp_shard=2, microbatches=2), MODEL),
           "ep": (dict(ep=2), dict(dp_replicate=2, dp_shard=2, ep=2), MOE)}
# Presets whose data parallelism is not FSDP2's: DDP, DeepSpeed, or written by hand to teach. They
# are layouts the mesh cannot name, so no degrees reproduce them.
NOT_NAMES = {"ddp", "cp", "dp_naive", "dp_bucketed", "zero1", "zero2", "zero3", "zero1_scratch", "tp_scratch",
             "pp_scratch", "single", "mesh"}


def test_every_preset_is_a_name_for_degrees_or_says_why_not():
    assert set(PRESETS) | NOT_NAMES == set(STRATEGIES), set(STRATEGIES) ^ (set(PRESETS) | NOT_NAMES)
    for name, (flags, degrees, _) in PRESETS.items():
        s = STRATEGIES[name]
        assert s.dp_impl == "fsdp" and s.tp_impl == "dtensor" and s.pp_impl in (None, "torch"), name
        asked = {k: v for k, v in degrees.items() if k != "microbatches"}
        assert degrees_for(TrainConfig(strategy=name, **flags), WORLD) == Degrees(**asked), name
    for name in NOT_NAMES - {"single", "mesh"}:
        s = STRATEGIES[name]
        assert s.dp_impl != "fsdp" or s.deepspeed or s.teaching, name


@pytest.fixture(scope="module")
def pairs():
    jobs = []
    for name, (flags, degrees, model) in PRESETS.items():
        jobs += [(replace(BASE, strategy=name, **flags), model), (replace(BASE, strategy="mesh", **degrees), model)]
    got = launch(runs, jobs, world_size=WORLD, timeout=600, quiet=True)[0]
    return {name: (got[2 * i], got[2 * i + 1]) for i, name in enumerate(PRESETS)}


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_trains_bit_for_bit_as_its_degrees(pairs, name):
    preset, mesh = pairs[name]
    assert preset["degrees"] == mesh["degrees"], name
    assert len(preset["loss"]) == STEPS and preset["loss"] == mesh["loss"], (name, preset["loss"], mesh["loss"])
