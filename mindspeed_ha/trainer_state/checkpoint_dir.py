"""A checkpoint directory on disk: its tracker, how a new iteration is put in place, the manifest of
checksums every checkpoint carries, and what ``--load`` checks before a tensor is read.

    DIR/latest_checkpointed_iteration.txt      the iteration ``--load`` takes
    DIR/iter_0000010/                          one checkpoint (megatron-core dist_checkpointing files)
    DIR/iter_0000010/ha_manifest.json          {"files": {name: {"bytes", "crc32", "rank"}}, ...}

A tracker that names a missing or incomplete directory, or that cannot be read, is an error naming
the path and the newest complete checkpoint — never a silent start from iteration 0 (an absent
tracker is a fresh start, as in Megatron-LM).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

from mindspeed_ha.events import get_logger

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ha_manifest.json"
log = get_logger("checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message names the path and what would work."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete(path: str) -> bool:
    """The directory holds a whole dist_checkpointing checkpoint (and every file its manifest lists,
    at its size)."""
    if not os.path.isfile(os.path.join(path, ".metadata")) or not os.path.isfile(os.path.join(path, "metadata.json")):
        return False
    manifest = read_manifest(path)
    return manifest is None or all(
        os.path.isfile(os.path.join(path, n)) and os.path.getsize(os.path.join(path, n)) == e["bytes"]
        for n, e in manifest["files"].items())


def newest_complete(root: str) -> tuple[int, str] | None:
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = re.fullmatch(r"iter_(\d{7})", name)
        if m and complete(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return max(found) if found else None


def tracker(root: str) -> int | None:
    """The iteration ``--load root`` takes; None when there is no tracker (a fresh start).
    Raises CheckpointError when the tracker is unreadable or names no complete checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    newest = newest_complete(root)
    hint = (f"the newest complete checkpoint there is iteration {newest[0]} ({newest[1]}): write {newest[0]} "
            f"into {path} to resume from it" if newest else "there is no complete checkpoint there: remove "
            f"{path} to start from scratch")
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        it = int(text)
    except ValueError:
        raise CheckpointError(f"--load {root}: {path} holds {text[:40]!r}, not an iteration; {hint}") from None
    aside = iter_dir(root, it) + "_old"
    if not complete(iter_dir(root, it)) and complete(aside):
        # A crash while ``publish`` rewrote this iteration: the copy moved aside is the whole one.
        shutil.rmtree(iter_dir(root, it), ignore_errors=True)
        os.replace(aside, iter_dir(root, it))
        log.warning("--load %s: iteration %d was being rewritten when the job stopped; took back its previous "
                    "copy (%s)", root, it, aside)
    if not complete(iter_dir(root, it)):
        what = "is missing" if not os.path.isdir(iter_dir(root, it)) else "is incomplete"
        raise CheckpointError(f"--load {root}: the tracker names iteration {it}, but {iter_dir(root, it)} {what}; "
                              f"{hint}")
    return it


def newest_checkpoint(root: str | None) -> tuple[int, str] | None:
    """(iteration, path) that ``--load root`` would take, or None (none, or a broken tracker)."""
    if not root:
        return None
    try:
        it = tracker(root)
    except CheckpointError:
        return None
    return (it, os.path.abspath(iter_dir(root, it))) if it is not None else None


# ---- putting a checkpoint in place ---------------------------------------------------------------
def publish(root: str, tmp: str, iteration: int) -> str:
    """Put the written ``tmp`` in place as ``iter_<iteration>`` and name it in the tracker, so that a
    crash at any step leaves the tracker naming a complete checkpoint: the files and the directory
    are fsynced; an existing copy of that iteration is moved aside, never deleted first; the tracker
    is replaced atomically; only then is the old copy removed."""
    final = iter_dir(root, iteration)
    for name in os.listdir(tmp):
        _fsync(os.path.join(tmp, name))
    _fsync(tmp)
    aside = None
    if os.path.exists(final):
        aside = f"{final}_old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(root)
    write_tracker(root, iteration)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync(root)


def remove_leftovers(root: str, keep: str | None = None) -> list[str]:
    """Half-written directories an interrupted save left (``*_tmp``), except ``keep``."""
    gone = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        if name.endswith("_tmp") and os.path.isdir(path) and path != keep:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
    return gone


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the manifest --------------------------------------------------------------------------------
def digest(path: str) -> str:
    """CRC-32 of the file: the check is for torn, partial and flipped writes, not tampering."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def own_files(path: str, rank: int, size: int) -> list[str]:
    """The files of a dist_checkpointing directory that ``rank`` (of ``size`` writers) wrote; rank 0
    answers for every file no rank-numbered name claims."""
    names = sorted(n for n in os.listdir(path) if n != MANIFEST)
    ours = [n for n in names if n.startswith(f"__{rank}_")]
    if rank == 0:
        ours += [n for n in names if not any(n.startswith(f"__{r}_") for r in range(size))]
    return ours


def checksums(path: str, rank: int, size: int) -> dict:
    return {n: {"rank": rank, "bytes": os.path.getsize(os.path.join(path, n)), "crc32": digest(os.path.join(path, n))}
            for n in own_files(path, rank, size)}


def write_manifest(path: str, manifest: dict) -> None:
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} cannot be read: the checkpoint is damaged") from None


def mismatches(path: str, manifest: dict, names: list[str]) -> list[str]:
    """Which of ``names`` differ from the manifest (missing, other size, other checksum)."""
    bad = []
    for name in names:
        entry, file = manifest["files"][name], os.path.join(path, name)
        if not os.path.isfile(file):
            bad.append(f"{file} is missing")
        elif os.path.getsize(file) != entry["bytes"]:
            bad.append(f"{file} has {os.path.getsize(file)} bytes, the manifest {entry['bytes']}")
        elif digest(file) != entry["crc32"]:
            bad.append(f"{file} does not match its checksum in {MANIFEST} (CRC-32 {digest(file)}, "
                       f"written {entry['crc32']})")
    return bad
