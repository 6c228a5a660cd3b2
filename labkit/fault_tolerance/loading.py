"""Reading a checkpoint back safely: nothing is unpickled beyond data, and tensors load in place.

``rank{r}.pt`` loads with ``torch.load(weights_only=True)``; DCP's pickled ``.metadata`` through an
allow-list of DCP's metadata classes (DCP itself calls ``pickle.load`` on it); DeepSpeed's files are
scanned with the weights-only unpickler before DeepSpeed loads them with ``weights_only=False``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from labkit.fault_tolerance.files import (
    CheckpointError,
    SafeReader,
    deepspeed_safe_globals,
    describe,
    fill,
    read_metadata,
    scan_weights_only,
    split,
    tensor_keys,
)

LOCAL = "local"  # state[LOCAL]: this rank's own values, saved per rank and restored only on the same world size


def is_engine(v: Any) -> bool:
    """A DeepSpeed engine, by what the checkpointer calls on it."""
    return hasattr(v, "save_checkpoint") and hasattr(v, "load_checkpoint") and hasattr(v, "module")


def open_plain(path: Path, rank: int, world: int, gather: Callable[[Any], list]) -> dict:
    """This rank's plain values of the checkpoint at ``path``, after every file that will be unpickled
    passed the safe unpicklers; a collective (every rank agrees to skip)."""
    own = path / f"rank{rank}.pt"
    err, saved = None, None
    try:  # weights_only: plain containers, numbers, strings and tensors; never arbitrary objects
        saved = torch.load(own if own.exists() else path / "rank0.pt", weights_only=True)
        if (path / ".metadata").exists():
            read_metadata(path)
        if saved["engines"]:  # this rank's share of DeepSpeed's files
            scan = sorted(p for key in saved["engines"] for p in (path / key).rglob("*.pt"))
            scan_weights_only(scan[rank::world], deepspeed_safe_globals())
    except Exception as e:  # noqa: BLE001 - every rank must agree to skip
        err = f"rank {rank}: {describe(e)}"
    errors = [e for e in gather(err) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    return saved


def merge(a: Any, b: Any) -> Any:
    """Two ranks' plain values as one: dicts united key by key, lists of names united, lists of the same
    length merged item by item (an optimizer's param_groups); otherwise the first rank's value."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{k: merge(v, b[k]) if k in b else v for k, v in a.items()}}
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, str) for x in a + b):
            return a + [x for x in b if x not in a]
        if len(a) == len(b):
            return [merge(x, y) for x, y in zip(a, b)]
    return a


def merged_skeleton(path: Path) -> dict:
    """The plain values of every rank's file of the checkpoint at ``path``, merged (:func:`merge`)."""
    files = sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
    out = None
    for f in files:
        skel = torch.load(f, weights_only=True)["skeleton"]
        out = skel if out is None else merge(out, skel)
    return out


def read_state(path: Path, step: int, saved: dict, template: dict | None, rank: int, same_world: bool,
               pg: dist.ProcessGroup | None, distributed: bool) -> dict:
    """The state saved at ``path``: tensors into ``template``'s (resharded by DCP) or, without one,
    whole on the CPU; DeepSpeed engines in the template load themselves."""
    own = path / f"rank{rank}.pt"
    if template is None:  # whole tensors: every rank's part (pipeline stages save different ones)
        saved = dict(saved, skeleton=merged_skeleton(path))
    wanted = tensor_keys(saved["skeleton"])
    if template is not None:
        flat: dict = {}
        split({k: v for k, v in template.items() if k != LOCAL and not is_engine(v)}, (), flat)
        flat = {k: v for k, v in flat.items() if k in wanted}
        missing = sorted(wanted - set(flat))
        if missing:  # a template of another model or optimizer: refuse rather than fill in None
            raise CheckpointError(f"step {step} holds {len(missing)} tensor(s) the template lacks, e.g. "
                                  f"{missing[:3]}; pass a template built like the saved state, or no template")
        if flat:
            dcp.load(flat, storage_reader=SafeReader(path), process_group=pg, no_dist=not distributed)
        for key in saved["engines"]:
            if key not in template:
                raise CheckpointError(f"step {step} holds a DeepSpeed engine under {key!r}; pass it in the template")
            template[key].load_checkpoint(str(path / key), tag="ckpt", load_module_strict=True)
    else:
        md = read_metadata(path) if wanted else None
        flat = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
                for k in wanted}
        if flat:
            dcp.load(flat, storage_reader=SafeReader(path), no_dist=True)
    state = fill(saved["skeleton"], flat)
    state[LOCAL] = saved["local"] if same_world and own.exists() else None
    for key in saved["engines"]:
        state[key] = template[key] if template is not None else None
    return state
