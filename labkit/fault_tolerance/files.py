"""The files of a labkit checkpoint: how a state is laid out, checksummed, written durably, read safely.

A state (nested dicts, lists and tuples) is split into its tensors, which go through
``torch.distributed.checkpoint`` (DCP) under path keys such as ``model/blocks.0.attn.qkv.weight``,
and a skeleton of plain values with a placeholder where each tensor was, saved with ``torch.save``
and read back with ``torch.load(weights_only=True)``. DCP's own ``.metadata`` is a pickle that DCP
reads with ``pickle.load``; here it is read through an allow-list of DCP's metadata classes, so a
planted pickle cannot run code. Checksums are XXH3 (xxHash, 64 bit) by default, a non-cryptographic
hash that reads faster than a disk writes; CRC-32 (the default where ``xxhash`` is not installed)
and SHA-256 are there to compare.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import warnings
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

try:
    import xxhash
except ModuleNotFoundError:  # a bare GPU image (torch and numpy): CRC-32, from the standard library
    xxhash = None

from labkit.core.checks import one_of
from labkit.fault_tolerance.errors import CheckpointError  # noqa: F401 - the files' error, re-exported

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# DCP warns on every save and load without a process group; one process is a supported case here.
# (A module-level filter: warnings.catch_warnings is not thread-safe, and async saves run in a thread.)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


HASHES = ("xxh3_64", "crc32", "sha256")  # the lab measures the throughput of each
DEFAULT_HASH = "xxh3_64" if xxhash is not None else "crc32"


def available_hashes() -> tuple[str, ...]:
    """The hashes this machine computes (XXH3 needs the ``xxhash`` package)."""
    return tuple(h for h in HASHES if h != "xxh3_64" or xxhash is not None)
TENSOR = "__dcp_tensor__"  # placeholder of a tensor in the plain-value skeleton
PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


def describe(err: BaseException) -> str:
    """One line per failure; DCP's CheckpointException carries every rank's exception and traceback."""
    if isinstance(err, dcp.CheckpointException):
        return "; ".join(f"{type(e).__name__}: {e}" for _, (e, _) in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


def free_space(directory: str | os.PathLike) -> str:
    """What a failed save's message adds: the free space where it wrote. torch's zip writer reports a
    full disk as "unexpected pos 704 vs 598", naming neither the disk nor the space."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    return f" [{free / 2**20:,.1f} MiB free on its filesystem]"


def file_digest(path: str | os.PathLike, algo: str | None = None, chunk: int = 8 << 20) -> str:
    """Checksum of a file, read in chunks: ``xxh3_64`` (the default where ``xxhash`` is installed),
    ``crc32`` (the default elsewhere) or ``sha256``."""
    algo = algo or DEFAULT_HASH
    one_of("hash", algo, HASHES, "hashes")
    if algo == "xxh3_64" and xxhash is None:
        raise ModuleNotFoundError("hash='xxh3_64' needs the package 'xxhash', which is not installed: pip install "
                                  "xxhash, or use hash='crc32'", name="xxhash")
    h = xxhash.xxh3_64() if algo == "xxh3_64" else hashlib.sha256() if algo == "sha256" else None
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if h is None:
                crc = zlib.crc32(block, crc)
            else:
                h.update(block)
    return f"{crc:08x}" if h is None else h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories holding them, deepest first."""
    for d, _, names in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(d))


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle with only DCP's own metadata classes allowed (no code execution)."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    _DCP_MD = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
               "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (module == "torch.distributed.checkpoint.metadata"
                                               and name in self._DCP_MD):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} from a checkpoint's DCP metadata")


def read_metadata(path: Path, files: set[str]) -> Metadata:
    """DCP's metadata of the checkpoint at ``path``, whose storage paths must all be among ``files``
    (the checkpoint's own): DCP opens ``path / relative_path``, and ``../step_5/...`` would read another."""
    with open(path / ".metadata", "rb") as f:
        md = MetadataUnpickler(f).load()
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(md, Metadata) or not all(isinstance(v, TensorStorageMetadata)
                                               for v in md.state_dict_metadata.values()):
        raise pickle.UnpicklingError("DCP metadata holds non-tensor entries, which this format never writes")
    storage = md.storage_data if isinstance(md.storage_data, dict) else None
    if storage is None:
        raise pickle.UnpicklingError("DCP metadata has no table of where each tensor is stored")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel not in files:
            raise pickle.UnpicklingError(f"DCP metadata points at {rel!r}, which is not a file of this checkpoint")
    return md


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with the metadata read (and checked) once, here, before DCP's load starts: when the
    file is gone (a writer's retention removed the step a reader was about to load, which
    ``load_latest`` then retries), DCP would log a traceback for its read and another for its per-rank
    fallback before failing; raised here, it is one ordinary error for the caller to handle."""

    def __init__(self, path: Path, files: set[str]) -> None:
        super().__init__(path)
        self.files = files
        self.metadata = read_metadata(Path(path), files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = self.metadata
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _plain(obj: Any, path: tuple) -> Any:
    """``obj`` if it is exactly a plain type, a NumPy scalar as the equal Python value (no information
    lost), else a TypeError naming the key: a subclass (``IntEnum``, ``np.str_``...) would save, and
    then every load would refuse it (``weights_only``), and a resume would start from nothing."""
    if type(obj) in PLAIN:
        return obj
    key = "/".join(map(str, path))
    if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        value = obj.item()
        if type(value) in PLAIN and (value == obj or value != value):  # value != value: NaN
            return value
    kind = next((f" (a subclass of {t.__name__})" for t in (bool, int, float, str, bytes) if isinstance(obj, t)), "")
    name = type(obj).__name__ if type(obj).__module__ == "builtins" else f"{type(obj).__module__}.{type(obj).__name__}"
    raise TypeError(f"state[{key!r}] is a {name}{kind}: it would save but "
                    "never load with weights_only; a checkpoint holds tensors, dicts, lists, tuples and plain "
                    "values (None, bool, int, float, str, bytes): convert it (int(x), str(x), x.tolist())")


def split(obj: Any, path: tuple, tensors: dict | None) -> Any:
    """The plain-value skeleton of ``obj``; its tensors go to ``tensors`` under a path key (with
    ``tensors=None`` they stay in place: ``state["local"]`` is saved whole), every other value is checked."""
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            return obj
        key = "/".join(map(str, path))
        if key in tensors:
            raise ValueError(f"state has two tensors at the same key path {key!r}")
        tensors[key] = obj
        return {TENSOR: key}
    if isinstance(obj, dict):  # OrderedDict (a state_dict) and the like save as a plain dict
        return {_plain(k, (*path, k)): split(v, (*path, k), tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(split(v, (*path, i), tensors) for i, v in enumerate(obj))
    return _plain(obj, path)


def check_loadable(data: bytes) -> None:
    """Raise unless a ``rank{r}.pt`` payload loads back with ``weights_only`` (the loader's own test)."""
    import io

    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch says which global it refused
        raise TypeError(f"the state would save but never load with weights_only: {e}") from None


def fill(skel: Any, tensors: dict) -> Any:
    if isinstance(skel, dict):
        if set(skel) == {TENSOR}:
            return tensors.get(skel[TENSOR])
        return {k: fill(v, tensors) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        return type(skel)(fill(v, tensors) for v in skel)
    return skel


def tensor_keys(skel: Any) -> set[str]:
    if isinstance(skel, dict):
        if set(skel) == {TENSOR}:
            return {skel[TENSOR]}
        return set().union(*(tensor_keys(v) for v in skel.values())) if skel else set()
    if isinstance(skel, (list, tuple)):
        return set().union(*(tensor_keys(v) for v in skel)) if skel else set()
    return set()


def deepspeed_safe_globals() -> list[type]:
    """Plain-data classes DeepSpeed's ZeRO checkpoints pickle (found by loading them weights-only)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def scan_weights_only(paths: list[Path], safe_globals: list) -> None:
    """Raise unless every file unpickles with torch's weights-only unpickler (DeepSpeed itself loads
    them with ``weights_only=False``). ``mmap`` leaves the tensor data on disk: only the pickles run."""
    with torch.serialization.safe_globals(safe_globals):
        for p in paths:
            torch.load(p, weights_only=True, mmap=True, map_location="cpu")
