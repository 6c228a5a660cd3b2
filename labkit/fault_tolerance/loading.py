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

from labkit.fault_tolerance import directory as ckdir
from labkit.fault_tolerance.files import (
    TENSOR,
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


def agreed(fn: Callable[[], Any], rank: int, gather: Callable[[Any], list]) -> Any:
    """``fn()`` on every rank; if it failed on any, a CheckpointError on all of them (every rank must
    agree to skip a checkpoint, or the ones that go on wait for the others in a collective)."""
    err, out = None, None
    try:
        out = fn()
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        err = (isinstance(e, ValueError), f"rank {rank}: {describe(e)}")
    errors = [e for e in gather(err) if e]
    if any(caller for caller, _ in errors):  # the caller's mistake (a template of another model): raise it
        raise ValueError("; ".join(msg for _, msg in errors))
    if errors:
        raise CheckpointError("; ".join(msg for _, msg in errors))
    return out


def verify(path: Path, rank: int, world: int, gather: Callable[[Any], list]) -> list[str]:
    """Problems of the checkpoint at ``path``: links and odd files first (before anything in it is
    opened), then the manifest, then each file's size and checksum (every rank checks a share)."""
    try:
        problems = ckdir.tree_problems(path)
        if not problems:
            m = ckdir.read_manifest(path)
            on_disk, _ = ckdir.files_of(path)
            problems = [f"{f}: missing" for f in m["files"] if f not in on_disk]
            problems += [f"{f}: not in the manifest" for f in on_disk if f not in m["files"]]
            problems += ckdir.check_files(path, m, sorted(set(on_disk) & set(m["files"]))[rank::world])
    except FileNotFoundError as e:  # a writer's retention removed it while we read
        problems = [f"removed while being read ({e.filename})"]
    except (OSError, ValueError, CheckpointError) as e:
        problems = [f"{ckdir.MANIFEST}: {e}"]
    return sorted({p for share in gather(problems) for p in share})


def _open(path: Path, rank: int, world: int) -> dict:
    own = path / f"rank{rank}.pt"
    # weights_only: plain containers, numbers, strings and tensors; never arbitrary objects
    saved = torch.load(own if own.exists() else path / "rank0.pt", weights_only=True)
    if (path / ".metadata").exists():
        read_metadata(path, set(ckdir.files_of(path)[0]))
    if saved["engines"]:  # this rank's share of DeepSpeed's files
        scan = sorted(p for key in saved["engines"] for p in (path / key).rglob("*.pt"))
        scan_weights_only(scan[rank::world], deepspeed_safe_globals())
    return saved


def open_plain(path: Path, rank: int, world: int, gather: Callable[[Any], list]) -> dict:
    """This rank's plain values of the checkpoint at ``path``, after every file that will be unpickled
    passed the safe unpicklers and DCP's storage paths were confined to the checkpoint; a collective."""
    return agreed(lambda: _open(path, rank, world), rank, gather)


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
    files = sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isascii() and p.stem[4:].isdigit() else -1)
    out = None
    for f in files:
        skel = torch.load(f, weights_only=True)["skeleton"]
        out = skel if out is None else merge(out, skel)
    return out


def overlay(mine: Any, saved: Any) -> Any:
    """The template's structure with the saved plain values: this rank's own tensors (and names of
    parameters) where another layout saved other ranks' parts, every other value as it was saved."""
    if isinstance(mine, dict) and isinstance(saved, dict):
        if set(mine) == {TENSOR}:
            return mine
        return {k: overlay(v, saved[k]) if k in saved else v for k, v in mine.items()}
    if isinstance(mine, list) and isinstance(saved, list):
        if all(isinstance(x, str) for x in mine + saved):
            return mine
        if len(mine) == len(saved):
            return [overlay(x, y) for x, y in zip(mine, saved)]
    return saved


def _resharded(path: Path, step: int, template: dict) -> tuple[dict, dict]:
    """For a rank of another layout: the template's tensors that the checkpoint holds (any rank's part)
    and the state's skeleton; a ValueError when the template asks for a tensor no rank saved."""
    merged, flat = merged_skeleton(path), {}
    skeleton = overlay(split({k: v for k, v in template.items() if k != LOCAL and not is_engine(v)}, (), flat),
                       {k: v for k, v in merged.items()})
    missing = sorted(set(flat) - tensor_keys(merged))
    if missing:
        raise ValueError(f"step {step} lacks {len(missing)} tensor(s) this layout needs, e.g. {missing[:3]}; "
                         "it was saved by another model or optimizer")
    return flat, skeleton


def plan_read(path: Path, step: int, saved: dict, template: dict | None, rank: int, same_world: bool,
              moved: bool = False) -> tuple[dict, Any, Any]:
    """What this rank will read of the checkpoint at ``path`` (no collective: every check that can refuse
    it happens here, before any rank enters DCP's load): ``(tensors by key, skeleton, own values)``.

    With ``template`` the tensors load into its own (resharded by DCP); without one, whole on the CPU.
    ``moved``: the run's layout is not the one that saved: each rank takes what it needs of every
    rank's part, and no rank's own values (its RNG states belong to the old ranks)."""
    own = path / f"rank{rank}.pt"
    if template is not None and moved:
        flat, skeleton = _resharded(path, step, template)
        return flat, skeleton, None
    if template is None:  # whole tensors: every rank's part (pipeline stages save different ones)
        saved = dict(saved, skeleton=merged_skeleton(path))
    wanted = tensor_keys(saved["skeleton"])
    if template is not None:
        flat: dict = {}
        split({k: v for k, v in template.items() if k != LOCAL and not is_engine(v)}, (), flat)
        flat = {k: v for k, v in flat.items() if k in wanted}
        missing = sorted(wanted - set(flat))
        if missing:  # a template of another model or optimizer: refuse rather than fill in None
            raise ValueError(f"step {step} holds {len(missing)} tensor(s) the template lacks, e.g. "
                             f"{missing[:3]}; pass a template built like the saved state, or no template")
        for key in saved["engines"]:
            if key not in template:
                raise ValueError(f"step {step} holds a DeepSpeed engine under {key!r}; pass it in the template")
    else:
        md = read_metadata(path, set(ckdir.files_of(path)[0])) if wanted else None
        flat = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
                for k in wanted}
    return flat, saved["skeleton"], saved["local"] if same_world and own.exists() else None


def read_planned(path: Path, planned: tuple[dict, Any, Any], engines: list[str], template: dict | None,
                 pg: dist.ProcessGroup | None, distributed: bool) -> dict:
    """Load what :func:`plan_read` planned (DCP's collective load, DeepSpeed engines' own) into a state."""
    flat, skeleton, local = planned
    files = set(ckdir.files_of(path)[0])
    if flat:
        together = template is not None and distributed
        dcp.load(flat, storage_reader=SafeReader(path, files), process_group=pg if together else None,
                 no_dist=not together)
    for key in engines if template is not None else []:
        template[key].load_checkpoint(str(path / key), tag="ckpt", load_module_strict=True)
    state = fill(skeleton, flat)
    state[LOCAL] = local
    for key in engines:
        state[key] = template[key] if template is not None else None
    return state
