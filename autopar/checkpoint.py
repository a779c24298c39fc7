"""Checkpoints of a planned step's state: sharded global arrays saved by the processes
that hold them, restored into any layout on any number of devices and processes.

A checkpoint is a directory: `metadata.json` (format version, one entry per leaf: its
path in the tree, shape, dtype and the chunks it was saved in) and one raw file per
distinct shard (`leaf<k>/<start>_<start>...bin`), written by the process whose device
holds that shard's first replica. Restoring reads, for every device of the target layout,
the part of each chunk that overlaps that device's index (`jax.make_array_from_callback`),
so a checkpoint saved under one plan resumes under another (other meshes, device counts,
processes). Every process must see the same directory (one machine, or a shared file
system).

Saving never damages an earlier checkpoint: everything is written to `<path>.partial`,
then moved into place after every process has finished; an interrupted save leaves the
previous checkpoint as it was.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autopar.distributed import barrier, everywhere, to_global

FORMAT_VERSION = 1
BARRIER_TIMEOUT_MS = 10 * 60 * 1000
_saves = 0     # the n-th save of every process is the same save (same script)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not match what it is restored into."""


@dataclass(frozen=True)
class Chunk:
    """One saved shard: its global index (start, stop per dimension) and file."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class LeafRecord:
    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]


def _chunks(x: jax.Array) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
    """(start, stop, device) of every distinct shard of a global array, the device being the
    lowest-id holder of that shard (the same answer in every process)."""
    owner: dict[tuple, Any] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        bounds = tuple((s.start or 0, x.shape[d] if s.stop is None else s.stop)
                       for d, s in enumerate(index))
        if bounds not in owner or device.id < owner[bounds].id:
            owner[bounds] = device
    return [(tuple(b[0] for b in bounds), tuple(b[1] for b in bounds), dev) for bounds, dev in sorted(owner.items())]


def save_checkpoint(path: str | os.PathLike, tree: Any) -> None:
    """Save a pytree of arrays (global jax.Arrays of any layout, or host values) to the
    directory `path`, replacing an earlier checkpoint there only once the new one is whole.
    With several processes every process must call it with the same tree."""
    global _saves
    _saves += 1
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    process = jax.process_index()
    if process == 0 and partial.exists():
        shutil.rmtree(partial)                     # the remains of an interrupted save
    _barrier(f"autopar/checkpoint/{_saves}/clean")
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    records = []
    for k, (keypath, leaf) in enumerate(leaves):
        x = leaf if isinstance(leaf, jax.Array) else to_global(leaf, everywhere())
        chunks = []
        for start, stop, device in _chunks(x):
            name = f"leaf{k}/" + ("_".join(map(str, start)) or "scalar") + ".bin"
            chunks.append(Chunk(start=start, stop=stop, file=name))
            if device.process_index == process:
                data = next(s.data for s in x.addressable_shards if s.device == device)
                target = partial / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as f:
                    f.write(np.ascontiguousarray(np.asarray(data)).tobytes())
                    f.flush()
                    os.fsync(f.fileno())
        records.append(LeafRecord(path=jax.tree_util.keystr(keypath), shape=tuple(x.shape),
                                  dtype=jax.numpy.dtype(x.dtype).name, chunks=tuple(chunks)))
    _barrier(f"autopar/checkpoint/{_saves}/written")
    if process == 0:
        (partial / "metadata.json").write_text(json.dumps(
            {"format_version": FORMAT_VERSION, "leaves": [asdict(r) for r in records]}, indent=1))
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        partial.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier(f"autopar/checkpoint/{_saves}/done")


def _barrier(name: str) -> None:
    barrier(name, BARRIER_TIMEOUT_MS)


def _read_metadata(path: Path) -> list[LeafRecord]:
    meta = path / "metadata.json"
    if not meta.exists():
        hint = " (an interrupted save left only .partial files)" if path.with_name(path.name + ".partial").exists() \
            else ""
        raise CheckpointError(f"{path} is not an autopar checkpoint: no metadata.json{hint}")
    try:
        d = json.loads(meta.read_text())
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{meta}: format_version {d.get('format_version')!r} is not {FORMAT_VERSION}, "
                                  f"the one this autopar reads")
        return [LeafRecord(path=r["path"], shape=tuple(r["shape"]), dtype=r["dtype"],
                           chunks=tuple(Chunk(start=tuple(c["start"]), stop=tuple(c["stop"]), file=c["file"])
                                        for c in r["chunks"])) for r in d["leaves"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta} is corrupt ({type(e).__name__}: {e}); restore an older checkpoint") from None


def _target_sharding(like: Any) -> jax.sharding.Sharding:
    sharding = getattr(like, "sharding", None)
    # with several processes, a layout on this process's devices alone (e.g. an array
    # from a single-process init) is not a global layout: replicate instead
    if isinstance(sharding, jax.sharding.Sharding) and (jax.process_count() == 1
                                                        or not sharding.is_fully_addressable):
        return sharding
    return everywhere()


def restore_checkpoint(path: str | os.PathLike, like: Any) -> Any:
    """The checkpoint at `path` as a pytree shaped like `like`: each leaf a global array in
    the layout of the matching leaf of `like` (a jax.Array, or a ShapeDtypeStruct with a
    `sharding`; anything else, and with several processes any layout on one process's
    devices only: replicated on all devices). The layout need not be the one it was saved
    in; a planned step reshards its inputs to its plan's layout."""
    path = Path(path)
    records = _read_metadata(path)
    leaves, tree = jax.tree_util.tree_flatten_with_path(like)
    if len(leaves) != len(records):
        raise CheckpointError(f"{path} holds {len(records)} arrays, the tree to restore into has {len(leaves)}; "
                              f"restore into the structure it was saved from")
    out = []
    for (keypath, leaf), rec in zip(leaves, records):
        where = jax.tree_util.keystr(keypath)
        if where != rec.path or tuple(np.shape(leaf)) != rec.shape:
            raise CheckpointError(f"{path}: saved {rec.path} {rec.shape}, restoring into {where} "
                                  f"{tuple(np.shape(leaf))}; the trees differ")
        dtype = np.dtype(jax.numpy.dtype(rec.dtype))
        out.append(jax.make_array_from_callback(rec.shape, _target_sharding(leaf),
                                                lambda index, rec=rec, dtype=dtype: _read(path, rec, dtype, index)))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), out)


def _read(path: Path, rec: LeafRecord, dtype: np.dtype, index: tuple) -> np.ndarray:
    """The region `index` of a saved leaf, assembled from the chunks that overlap it."""
    lo = tuple(s.start or 0 for s in index) + (0,) * (len(rec.shape) - len(index))
    hi = tuple(rec.shape[d] if d >= len(index) or index[d].stop is None else index[d].stop
               for d in range(len(rec.shape)))
    out = np.empty(tuple(h - l for l, h in zip(lo, hi)), dtype)
    filled = 0
    for c in rec.chunks:
        a = tuple(max(l, s) for l, s in zip(lo, c.start))
        b = tuple(min(h, e) for h, e in zip(hi, c.stop))
        if any(x >= y for x, y in zip(a, b)):
            continue
        shape = tuple(e - s for s, e in zip(c.start, c.stop))
        file = path / c.file
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        try:
            raw = file.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: chunk {c.file} of {rec.path} cannot be read ({e.strerror})") from None
        if len(raw) != want:
            raise CheckpointError(f"{path}: chunk {c.file} of {rec.path} has {len(raw)} bytes, expected {want} "
                                  f"(truncated or corrupt); restore an older checkpoint")
        data = np.frombuffer(raw, dtype).reshape(shape)
        out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = \
            data[tuple(slice(x - s, y - s) for x, y, s in zip(a, b, c.start))]
        filled += int(np.prod([y - x for x, y in zip(a, b)], dtype=np.int64))
    if filled != out.size:
        raise CheckpointError(f"{path}: the chunks of {rec.path} do not cover {index}; the checkpoint is incomplete")
    return out
