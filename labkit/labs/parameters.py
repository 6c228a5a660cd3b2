"""A lab's profile made concrete: overrides applied, and a ``gpu`` profile fitted to the GPUs there are.

A ``gpu`` profile is written for a node; :func:`fit_to_gpus` makes it run on 1, 2, 4 or 8 GPUs:
every world size, sweep and degree is clamped to what exists (tensor-parallel degrees to what
divides the heads, pipeline stages to what the layers allow), and ``multi_rank`` tells a lab
whether its parts that need two ranks or more can run (the lab then says which it skipped).
``python -m labkit resolve LAB gpu --gpus N`` prints the result without looking for GPUs.
"""
from __future__ import annotations

import math
from typing import Any

from labkit.core.checks import MAX_COUNT, brief, brief_path, positive_int
from labkit.labs.param_choices import check_choice
from labkit.labs.param_choices import shown as _shown
from labkit.labs.profiles import PROFILES


class Params(dict):
    """A lab's parameters that remember which of its profile's keys the lab read: a key it never reads
    is one a reader could change (``-p``) to no effect, so the lab's metrics name those
    (``params_unread``) and the suite holds that list empty (tests/test_labs.py). Printing them all
    (``P.items()``) is not reading them."""

    def __init__(self, values: dict, declared: dict) -> None:
        super().__init__(values)
        self.declared, self.read = set(declared), set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def __iter__(self):  # dict(P) and {**P} then go through __getitem__, and count as reads
        return iter(list(self.keys()))

    def unread(self) -> list[str]:
        """The profile's keys the lab has not read."""
        return sorted(self.declared - self.read)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _profile(lab: str, profile: str) -> dict:
    """A copy of ``lab``'s ``profile``, or a ValueError listing what exists."""
    if lab not in PROFILES:
        raise ValueError(f"lab={brief_path(lab)} has no profiles; labs with profiles: {sorted(PROFILES)}")
    if profile not in PROFILES[lab]:
        raise ValueError(f"PROFILE={brief_path(profile)} is unknown for lab {lab!r}; valid profiles: "
                         f"{list(PROFILES[lab])}")
    return dict(PROFILES[lab][profile])


# Counts: an override must be a whole number of at least 1. Fractions: at least 0 and below 1.
COUNTS = ("steps", "batch_size", "n_layer", "n_head", "n_embd", "block_size", "world_size", "microbatches",
          "grad_accum", "vocab_size", "gpus")
FRACTIONS = ("dropout",)
# Numbers that must be above 0 (the loop or the check refuses 0 later, once the lab has started)
POSITIVE = ("lr", "bucket_cap_mb", "ring_numel")


def check_override(key: str, value: Any, default: Any, name: str = "", whole: Any = None) -> None:
    """A ValueError naming ``key`` unless ``value`` has the type of the profile's ``default`` (an int
    where a float is expected is fine) and a sensible range: counts at least 1, fractions in [0, 1),
    no negative number where the profile's is not negative. A list's items, and a mapping's values,
    are held the same way (:func:`_check_items`), here rather than in the kernel papermill starts.
    ``name`` and ``whole`` (the profile's whole list) are for an item's message."""
    name = name or f"OVERRIDES[{key!r}]"

    def named(kind: str) -> str:
        return f"{name}={_shown(value)} must be {kind} (the profile has {_shown(default if whole is None else whole)})"

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int) or key in COUNTS:
        ok = isinstance(value, int) and not isinstance(value, bool) or (key in COUNTS and isinstance(default, str)
                                                                        and value == default)
    elif isinstance(default, float):
        ok = number
    elif default is None:
        ok = True
    else:
        ok = isinstance(value, type(default))
    if not ok:
        kinds = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", list: "a list",
                 dict: "a mapping"}
        raise ValueError(named("a whole number" if key in COUNTS else kinds.get(type(default), type(default).__name__)))
    if isinstance(value, (list, dict)):
        _check_items(name, value, default)
    if key and isinstance(value, (str, list)):
        check_choice(name, key, value)
    if not number:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(named("finite"))
    if abs(value) > MAX_COUNT:
        raise ValueError(named(f"at most {MAX_COUNT:.0e} in size"))
    if key in COUNTS and value < 1:
        raise ValueError(named("a whole number of at least 1"))
    if key in FRACTIONS and not 0 <= value < 1:
        raise ValueError(named("at least 0 and below 1"))
    if key in POSITIVE and value <= 0:
        raise ValueError(named("above 0"))
    if isinstance(default, (int, float)) and default >= 0 and value < 0:
        raise ValueError(named("at least 0"))
    if whole is not None and isinstance(default, (int, float)) and default > 0 and value <= 0:
        raise ValueError(named("above 0, as every one of the profile's is"))  # a world size of 0, 0 steps


def _check_items(name: str, value: list | dict, default: list | dict) -> None:
    """Each item of a list override as the profile's items are (numbers held against the smallest of
    them: a list of positive world sizes takes no 0; a list of triples takes triples), each value of
    a mapping as the profile's value of its key, which it must have, every one."""
    if isinstance(default, dict):
        if set(value) != set(default):
            raise ValueError(f"{name} must have the keys {sorted(default)}, got {_shown(sorted(value, key=str))}")
        for k, v in value.items():
            check_override("", v, default[k], f"{name}[{k!r}]", default)
        return
    if default and not value:
        raise ValueError(f"{name}=[] must hold at least one item (the profile has {_shown(default)})")
    numbers = [d for d in default if isinstance(d, (int, float)) and not isinstance(d, bool)]
    like = (min(numbers) if numbers and len(numbers) == len(default) else default[0]) if default else None
    if numbers and any(isinstance(d, float) for d in numbers):
        like = float(like)  # a list of floats takes ints too
    lengths = {len(d) for d in default if isinstance(d, list)}
    for i, item in enumerate(value):
        if isinstance(item, list) and len(lengths) == 1 and len(item) not in lengths:
            raise ValueError(f"{name}[{i}]={_shown(item)} must hold {lengths.pop()} items, as the profile's do "
                             f"({_shown(default)})")
        if like is not None:
            check_override("", item, like, f"{name}[{i}]", default)


def _per_rank_batch(p: dict, world_size: int | None) -> None:
    if p.get("batch_size") == "8 per rank":  # the gpu profiles scale the global batch with the ranks
        p["batch_size"] = 8 * world_size


def _rank_counts(n: int) -> list[int]:
    """Rank counts of a sweep on ``n`` GPUs: 2, then every multiple of 4, then ``n`` itself."""
    return sorted({k for k in (2, *range(4, n + 1, 4), n) if 2 <= k <= n})


# Labs that are about splitting one model over ranks (or comparing replicas): below this many GPUs,
# their gpu profile runs the cpu profile on CPU processes instead (and says so), rather than pretend
# on one GPU.
MIN_GPUS = {"tensor_parallel": 2, "pipeline_parallel": 2, "communication": 2, "long_context_experts": 2,
            "composing": 2, "failures_at_scale": 2}


def fit_layout(n: int, n_head: int, n_layer: int) -> dict[str, int]:
    """A 3-D layout of ``n`` GPUs for the composing lab: TP 2 inside the node, 2 pipeline stages when
    4 GPUs or more, FSDP over the rest."""
    tp = 2 if n % 2 == 0 and n_head % 2 == 0 else 1
    pp = 2 if n % (2 * tp) == 0 and n >= 4 and n_layer >= 2 else 1
    return {"tp": tp, "pp": pp, "dp_shard": n // (tp * pp)}


def fit_to_gpus(lab: str, p: dict, n: int) -> dict:
    """``p`` (a profile of ``lab``) fitted to ``n`` GPUs: nothing in it asks for more than ``n``."""
    positive_int("gpus", n)
    if n < MIN_GPUS.get(lab, 1):
        p.clear()
        p.update(_profile(lab, "cpu"), gpus=n, multi_rank=True,
                 note=f"{lab} needs {MIN_GPUS[lab]} GPUs and this run has {n}: it runs the cpu profile on "
                      "CPU processes instead")
        return p
    p["gpus"] = n
    if p.get("world_size") == "all":
        p["world_size"] = n
    for key in ("ring_world_sizes", "sweep_world_sizes"):
        if p.get(key) in ("1..world_size", "2..world_size"):
            p[key] = ([1] if p[key].startswith("1") else []) + _rank_counts(n)
    if lab == "tensor_parallel":  # degrees that divide the heads, on GPUs that exist
        p["degrees"] = [d for d in p["degrees"] if d <= n and p["n_head"] % d == 0]
        p["world_size"] = max(p["degrees"])
    if lab == "pipeline_parallel":  # stages that exist; two layer chunks each when interleaved
        fits = [k for k in range(1, n + 1) if p["n_layer"] >= 2 * k and p["microbatches"] >= k]
        p["world_size"] = min(p["world_size"], max(fits))
        p["mem_pp"] = min(p["mem_pp"], max(k for k in fits if p["mem_microbatches"] >= k))
    if p.get("layout_3d") == "fit":
        p["layout_3d"] = fit_layout(n, p["n_head"], p["n_layer"])
    if "hsdp_world" in p:  # a replicas x shard mesh needs every one of its ranks
        p["hsdp_world"] = min(p["hsdp_world"], n)
    if isinstance(p.get("world_size"), int):
        p["world_size"] = min(p["world_size"], n)
        p["multi_rank"] = p["world_size"] >= 2
    return p


def require(*packages: str) -> None:
    """Stop a lab at its first cell when a package it needs is not installed: one line naming it (a
    skip under ``make gpu-check``), not a failure in a rank half-way through the lab."""
    import importlib.util

    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"this lab needs the package {package!r}, which is not installed",
                                      name=package)


def can_run(p: dict, ranks: int, what: str) -> bool:
    """Whether a part of a lab that needs ``ranks`` ranks runs under parameters ``p``; when it does not
    (a ``gpu`` profile on fewer GPUs), say so in the lab's output."""
    if p.get("device") != "cuda" or p.get("gpus", ranks) >= ranks:
        return True
    print(f"[{what}] needs {ranks} GPUs and this run has {p['gpus']}: skipped")
    return False


def resolve(lab: str, profile: str = "cpu", gpus: int | None = None, **overrides) -> dict:
    """The parameters of ``lab`` under ``profile``, with ``overrides`` applied; clear errors otherwise.

    A ``gpu`` profile is fitted to ``gpus`` GPUs, or to the GPUs this machine has when ``gpus`` is None
    (an error when it has none, unless ``overrides`` moves the lab to another device)."""
    p = _profile(lab, profile)
    unknown = set(overrides) - set(p)
    if unknown:
        raise ValueError(f"OVERRIDES has unknown keys {sorted(unknown)}; valid keys: {sorted(p)}")
    for key, value in overrides.items():
        check_override(key, value, p[key])
    if p.get("device") == "cuda":
        n = gpus if gpus is not None else _gpu_count()
        if n == 0 and "device" not in overrides:
            raise ValueError(f"PROFILE={profile!r} needs CUDA GPUs and found none; use PROFILE='cpu' or 'ci' "
                             f"here (python -m labkit resolve {lab} {profile} --gpus N prints what it would run "
                             "with on N GPUs, without running it)")
        fit_to_gpus(lab, p, n or 1)
    elif isinstance(p.get("world_size"), int):
        p["multi_rank"] = p["world_size"] >= 2
    _per_rank_batch(p, p.get("world_size") or p.get("gpus"))
    p.update(overrides)
    return Params(p, declared=_profile(lab, profile))


def profile_world_size(lab: str, profile: str) -> int:
    """The ranks ``profile`` of ``lab`` names; a ValueError asking for ``--world-size`` where it names
    none (a gpu profile runs on every GPU found, which a login node cannot know)."""
    world = _profile(lab, profile).get("world_size")
    if not isinstance(world, int):
        raise ValueError(f"PROFILE={profile!r} of lab {lab!r} runs on world_size={world!r} ranks: give "
                         "--world-size N, the ranks the job will have")
    return world


def train_flags(lab: str, profile: str, world_size: int) -> list[str]:
    """The ``python -m labkit.train`` flags a lab profile sets (model shape, batch, steps, lr, seed...),
    for batch scripts that train at a lab's size. Device and world size are the scheduler's to say,
    so they are left out, and nothing here looks for GPUs (a login node has none)."""
    from labkit.train.cli import flags_from

    p = _profile(lab, profile)
    positive_int("world_size", world_size)
    _per_rank_batch(p, world_size)
    return flags_from({k: v for k, v in p.items() if k not in ("device", "world_size")})
