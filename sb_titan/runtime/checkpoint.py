"""Checkpoint integrity: a checksum manifest per checkpoint, written last, verified on load.

DCP writes no checksums and no completion marker: a flipped byte in a `.distcp` loads
silently (and trains on, into the next checkpoint), and a save that died halfway is
found, if at all, deep inside the ranks. Here every checkpoint folder `step-N/` gets
`sb_integrity.json` = {file: {bytes, xxh3_64}} over every file the save wrote. It is
written once the save has finished on every rank (for an asynchronous save: when the
next save, or the last one, waits for it), by rank 0, after the ranks have hashed their
own files — so its presence *is* the completion marker. A resume loads the newest
complete folder, skipping newer ones a crash left without a manifest (one line names
them); the purge (`keep_latest_k`) counts complete folders only, so the last complete
checkpoint stays until the next one is finalised. Loading verifies the manifest first
(size and checksum of every file, no file missing or unlisted) and stops with one line
naming the file and step; `checkpoint.fallback_to_previous` loads the newest earlier
checkpoint that verifies instead, with a warning.

Checksum: xxHash's XXH3-64 (PyPI `xxhash`, maintained, manylinux wheels). It hashes
~20 GB/s per core, so verification is bound by the disk, not the hash; zlib.crc32
(~3 GB/s here) would make checksumming a large checkpoint cost a multiple of reading
it. It detects accidental corruption only, which is the point: it is not a MAC.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import CheckpointException
from torchtitan.tools.logging import logger

from sb_titan.compat.checkpoint import CheckpointHooks
from sb_titan.runtime.run_record import Layout, layout_mismatch, read_record, write_record
from sb_titan.util.files import write_atomic

MANIFEST = "sb_integrity.json"
FORMAT = 1
ALGORITHM = "xxh3_64"
CHUNK = 8 << 20
_STEP_DIR = re.compile(r"step-(\d+)")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint that must not be loaded; the message is one line naming file and step."""


class CheckpointLayoutError(CheckpointIntegrityError):
    """A checkpoint saved on another layout (runtime/run_record.py): its data-loader
    state is per DP rank, and its step size is the global batch it was saved with."""


# -- files and checksums ---------------------------------------------------------------------
def checksum(path: Path) -> str:
    h = xxhash.xxh3_64()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def list_files(step_dir: Path) -> list[str]:
    """Every file under the checkpoint folder (relative, sorted), the manifest excluded."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = (Path(root) / name).relative_to(step_dir).as_posix()
            if not rel.startswith(MANIFEST):  # the manifest and its temporary file
                out.append(rel)
    return sorted(out)


def owner(rel: str, index: int, world: int) -> int:
    """Rank that hashes a file: the rank that wrote a `__{rank}_{i}.distcp` (its page
    cache still holds it), round-robin for the rest (`.metadata`, safetensors)."""
    m = _RANK_FILE.fullmatch(rel)
    if m and int(m.group(1)) < world:
        return int(m.group(1))
    return index % world


def hash_share(step_dir: Path, files: list[str], rank: int, world: int) -> dict[str, dict]:
    entries = {}
    for i, rel in enumerate(files):
        if owner(rel, i, world) == rank:
            path = step_dir / rel
            entries[rel] = {"bytes": path.stat().st_size, ALGORITHM: checksum(path)}
    return entries


def write_manifest(step_dir: Path, entries: dict[str, dict]) -> None:
    """Atomically (temporary file, fsync, rename): a reader sees all of it or none."""
    body = {"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}
    write_atomic(step_dir / MANIFEST, json.dumps(body, indent=1), durable=True)


def _where(step_dir: Path) -> str:
    m = _STEP_DIR.fullmatch(step_dir.name)
    return f"checkpoint step {m.group(1)}" if m else f"checkpoint {step_dir}"


def read_manifest(step_dir: Path) -> dict[str, dict]:
    """The manifest's {file: entry}; a missing one means the save never finished."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CheckpointIntegrityError(
            f"{_where(step_dir)} is incomplete: {path} is missing (the save did not finish, "
            "or an sb_titan without integrity checks wrote it; checkpoint.allow_unverified "
            "= true loads such checkpoints unchecked)"
        )
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or body.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {body.get('format')}, algorithm {body.get('algorithm')}")
        files = body["files"]
        if not all(isinstance(e.get("bytes"), int) and ALGORITHM in e for e in files.values()):
            raise ValueError("an entry lacks bytes or checksum")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointIntegrityError(f"{_where(step_dir)}: unreadable {path}: {e}") from None
    return files


def verify(step_dir: str | Path, *, checksums: bool = True, rank: int = 0, world: int = 1) -> None:
    """Raise CheckpointIntegrityError (one line, naming file and step) unless the folder
    holds exactly the manifest's files, each of the listed size and, with `checksums`,
    checksum. Structure and sizes are checked by every caller; the checksums only of the
    files `owner` gives to `rank` (so ranks split the reading)."""
    step_dir = Path(step_dir)
    where = _where(step_dir)
    if not step_dir.is_dir():
        raise CheckpointIntegrityError(f"{where}: {step_dir} is not a folder")
    if not os.access(step_dir, os.R_OK | os.X_OK):
        raise CheckpointIntegrityError(f"{where}: {step_dir} is not readable")
    listed = read_manifest(step_dir)
    present = list_files(step_dir)
    for rel in sorted(set(present) - set(listed)):
        raise CheckpointIntegrityError(
            f"{where}: {step_dir / rel} is not in {MANIFEST} (written after the save, "
            "or left over from another one)"
        )
    for rel, entry in listed.items():
        path = step_dir / rel
        if not path.is_file():
            raise CheckpointIntegrityError(f"{where} is corrupted: {path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointIntegrityError(
                f"{where} is corrupted: {path} has {size} bytes, {MANIFEST} says "
                f"{entry['bytes']} (truncated or overwritten)"
            )
    if not checksums:
        return
    for i, rel in enumerate(sorted(listed)):
        if owner(rel, i, world) != rank:
            continue
        path = step_dir / rel
        try:
            got = checksum(path)
        except OSError as e:
            raise CheckpointIntegrityError(f"{where}: cannot read {path}: {e}") from None
        if got != listed[rel][ALGORITHM]:
            raise CheckpointIntegrityError(
                f"{where} is corrupted: {path} has {ALGORITHM} {got}, {MANIFEST} says "
                f"{listed[rel][ALGORITHM]}"
            )


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` folder, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted((s, p) for s, p in found if p.is_dir())[::-1]


# -- collective save / load --------------------------------------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def finalize(step_dir: str | Path) -> None:
    """After a save finished on every rank: hash, then rank 0 writes the manifest (last).
    Collective when a process group exists (every rank must call it)."""
    step_dir = Path(step_dir)
    rank, world = _rank_world()
    files = [list_files(step_dir) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(files, src=0)  # one listing, so shares never overlap
    share = hash_share(step_dir, files[0], rank, world)
    shares = [share]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, share)
    if rank == 0:
        write_manifest(step_dir, {k: v for s in shares for k, v in s.items()})
    if world > 1:
        dist.barrier()


def verify_everywhere(step_dir: str | Path) -> None:
    """verify() with the checksums split over the ranks; every rank raises the same error."""
    rank, world = _rank_world()
    try:
        verify(step_dir, rank=rank, world=world)
        error = None
    except CheckpointIntegrityError as e:
        error = str(e)
    errors = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointIntegrityError(first)


def _unverified_ok(step_dir: Path) -> bool:
    """A checkpoint without manifest that TorchTitan itself would consider complete."""
    return (step_dir / ".metadata").is_file() or (
        step_dir / "model.safetensors.index.json"
    ).is_file()


def is_complete(step_dir: Path, allow_unverified: bool) -> bool:
    """A finished save: its manifest is there; with `allow_unverified`, also a folder
    without one whose DCP save finished (`.metadata`, written after every rank's data),
    i.e. a checkpoint from before integrity checks or one whose hashing was cut short."""
    return (step_dir / MANIFEST).exists() or (allow_unverified and _unverified_ok(step_dir))


def _newest_complete(
    folder: Path, dirs: list[tuple[int, Path]], allow_unverified: bool
) -> tuple[int, str | None]:
    """The step a resume without `load_step` loads → (step, note). Newer folders whose
    save never finished (a crash between a save and its manifest) are skipped, with one
    line naming them and the step loaded. If no folder is complete the newest is
    returned (and refused as incomplete), unless none has DCP's `.metadata` either: then
    nothing was ever saved in full and the run starts as without a checkpoint (-1)."""
    complete = [s for s, p in dirs if is_complete(p, allow_unverified)]
    if complete and complete[0] == dirs[0][0]:
        return complete[0], None
    skipped = [s for s, _ in dirs if not complete or s > complete[0]]
    names = ", ".join(f"step-{s}" for s in skipped)
    why = f"{MANIFEST} missing: the save did not finish"
    if complete:
        return complete[0], (
            f"skipping incomplete checkpoint {names} in {folder} ({why}); resuming from "
            f"checkpoint step {complete[0]}, the newest complete one"
        )
    if any(_unverified_ok(p) for _, p in dirs):
        return dirs[0][0], None  # maybe written without integrity checks: refused below
    return -1, f"skipping incomplete checkpoint {names} in {folder} ({why}); none is complete"


def choose_step(
    folder: Path, step: int, *, fallback: bool, allow_unverified: bool, check
) -> tuple[int, str | None]:
    """The step to load from `folder` (`step` = -1: the newest complete `step-N`, see
    `_newest_complete`) → (step or -1 for none, warning or None). `check(step_dir)`
    raises CheckpointIntegrityError; on one, `fallback` tries older steps, newest first."""
    dirs = step_dirs(folder)
    skipped = None
    if step == -1:
        if not dirs:
            return -1, None
        step, skipped = _newest_complete(folder, dirs, allow_unverified)
        if step == -1:
            return -1, skipped
    target = folder / f"step-{step}"
    try:
        note = _check_one(target, allow_unverified, check)
        return step, "; ".join(w for w in (skipped, note) if w) or None
    except CheckpointIntegrityError as e:
        if not fallback:
            raise CheckpointIntegrityError(
                f"{e}; checkpoint.fallback_to_previous = true loads the newest earlier "
                "checkpoint that verifies"
            ) from None
        first = "; ".join(w for w in (skipped, str(e)) if w)
    for s, path in dirs:
        if s >= step:
            continue
        try:
            note = _check_one(path, allow_unverified, check)
        except CheckpointIntegrityError as e:
            logger.warning(f"Not loading it either: {e}")
            continue
        warning = f"{first}; loading checkpoint step {s} instead (checkpoint.fallback_to_previous)"
        return s, warning if note is None else f"{warning}; {note}"
    raise CheckpointIntegrityError(f"{first}; and no earlier checkpoint in {folder} verifies")


def stale_steps(
    folder: Path, keep: int, allow_unverified: bool, in_flight: Path | None = None
) -> list[Path]:
    """What a purge (`keep_latest_k` = `keep` > 0) deletes: complete checkpoints older
    than the newest `keep` complete ones, and incomplete folders (left by a crash)
    older than the newest complete one. A save still in flight, and any incomplete
    folder newer than the newest complete checkpoint, never count and are never
    deleted, so the last complete checkpoint stays until a newer one is finalised."""
    dirs = [(s, p) for s, p in step_dirs(folder) if in_flight is None or p != Path(in_flight)]
    complete = [(s, p) for s, p in dirs if is_complete(p, allow_unverified)]
    if not complete:
        return []
    newest = complete[0][0]
    kept = {s for s, _ in complete[:keep]}
    return [p for s, p in reversed(dirs) if s < newest and s not in kept]


def _check_one(step_dir: Path, allow_unverified: bool, check) -> str | None:
    if allow_unverified and not (step_dir / MANIFEST).exists() and _unverified_ok(step_dir):
        return f"{_where(step_dir)} has no {MANIFEST}: loading it unverified (allow_unverified)"
    check(step_dir)
    return None


def check_layout(step_dir: Path, current: Layout | None, reshard: bool) -> None:
    """A resume finds the layout its checkpoint was saved on (its run record's). Step 0,
    a seed checkpoint that TorchTitan loads model-only, fits any layout; so does a
    checkpoint without a record (saved before runs kept one)."""
    m = _STEP_DIR.fullmatch(step_dir.name)
    if current is None or (m is not None and int(m.group(1)) == 0):
        return
    try:
        record = read_record(step_dir)
    except ValueError as e:
        raise CheckpointIntegrityError(f"{_where(step_dir)}: {e}") from None
    mismatch = None if record is None else layout_mismatch(record, current, _where(step_dir))
    if mismatch is None:
        return
    if not reshard:
        raise CheckpointLayoutError(
            f"{mismatch}; resume it on the layout it was saved on, or reshard it "
            "(checkpoint.reshard)"
        )
    saved = Layout(**record["layout"])
    if saved.global_batch != current.global_batch:
        raise CheckpointLayoutError(
            f"{mismatch}; checkpoint.reshard keeps the global batch: set "
            f"training.global_batch_size = {saved.global_batch}"
        )
    logger.info(f"{mismatch}: resharding it (checkpoint.reshard)")


def load_failure(error: BaseException, checkpoint_id: str) -> Exception:
    """DCP's CheckpointException (a BaseException: `except Exception` misses it) as one
    line naming the checkpoint and the first rank's cause. A missing key or a shape that
    does not fit repeats on every restart (CheckpointIntegrityError, not retried); an
    I/O error may not (RuntimeError, retried)."""
    failures = getattr(error, "failures", {}) or {}
    causes = [exc for exc, _ in failures.values()]
    rank, (first, _) = next(iter(sorted(failures.items())), (None, (error, None)))
    lines = str(first).strip().splitlines() or [""]
    line = f"cannot load checkpoint {checkpoint_id}: {type(first).__name__}: {lines[0]}"
    line += "" if rank is None else f" (rank {rank})"
    if causes and not any(isinstance(c, OSError) for c in causes):
        return CheckpointIntegrityError(line)
    return RuntimeError(line)


# -- TorchTitan's checkpointer, with integrity ---------------------------------------------------
class IntegrityCheckpointManager(CheckpointHooks):
    """TorchTitan's DCP CheckpointManager + a checksum manifest per save, verified on load."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointHooks.Config):
        fallback_to_previous: bool = False
        """On a complete checkpoint that fails verification, warn and load the newest
        earlier one that passes, instead of stopping. (Incomplete ones, without a
        manifest, are skipped for the newest complete one without it.)"""
        allow_unverified: bool = False
        """Count checkpoints without a manifest whose DCP save finished (`.metadata`:
        written before sb_titan checked integrity, or hashing cut short) as complete and
        load them unchecked, with a warning. A folder without `.metadata` is skipped."""
        verify_before_launch: bool = True
        """`--check-config` (run_train.sh, before torchrun) also checksums the checkpoint
        to be loaded: one extra read of it. Off: sizes only there; the ranks still verify
        checksums before loading."""
        reshard: bool = False
        """Resume a checkpoint saved on another layout (world size, parallel degrees,
        micro-batches per rank) at the same global batch: DCP reshards the weights and
        the optimizer, and the loader's state is the global plan's, so the run trains
        the rest of the epoch's order exactly once. Without it, another layout is
        refused before ranks spawn, naming both."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.integrity = config
        self._unfinalized: str | None = None  # async save in flight: step folder
        self._saving: str | None = None  # the save TorchTitan's purge runs inside
        self.run_record: dict | None = None
        """The run's record (runtime/run_record.py), set by the trainer: written into every
        step folder before its manifest, and its layout checked on every resume."""

    def save_checkpoint(self, curr_step: int, last_step: bool) -> bool:
        if not self.should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # finalizes the previous async save first
        step_dir = self.checkpoint_dir(curr_step)
        if _rank_world()[0] == 0 and os.path.exists(os.path.join(step_dir, MANIFEST)):
            os.remove(os.path.join(step_dir, MANIFEST))  # overwriting: not complete until done
        self._saving = step_dir
        try:
            saved = self.stock_save(curr_step, last_step)
        finally:
            self._saving = None
        if saved and self.run_record is not None and _rank_world()[0] == 0:
            write_record(step_dir, self.run_record)  # before the manifest, which lists it
        if saved and self.save_future is None:
            finalize(step_dir)
        elif saved:
            self._unfinalized = step_dir
        return saved

    def purge_stale(self) -> None:
        """TorchTitan's purge counts every `step-N` folder, the one being saved and any a
        crash left incomplete included, so it can delete the last complete checkpoint
        before the new one is finalised; here only complete ones count (`stale_steps`)."""
        if not self.should_purge():
            return
        for path in stale_steps(
            Path(self.folder), self.keep_latest_k, self.integrity.allow_unverified, self._saving
        ):
            self.purge_queue.put(str(path))

    def saving_finished(self) -> None:
        if self._unfinalized is not None:
            step_dir, self._unfinalized = self._unfinalized, None
            finalize(step_dir)

    def load_checkpoint(self, step: int) -> bool:
        folder = Path(self.folder)
        if folder.exists():
            step, warning = choose_step(
                folder,
                step,
                fallback=self.integrity.fallback_to_previous,
                allow_unverified=self.integrity.allow_unverified,
                check=verify_everywhere,
            )
            if warning:
                logger.warning(warning)
            if step != -1 and self.run_record is not None:
                current = Layout(**self.run_record["layout"])
                check_layout(folder / f"step-{step}", current, self.integrity.reshard)
        if step == -1 and self.initial_load_path and not self.initial_load_in_hf:
            path = Path(self.initial_load_path)
            if (path / MANIFEST).exists():
                verify_everywhere(path)
            else:
                logger.warning(f"{path} has no {MANIFEST}: loading it unverified")
        try:
            return self.stock_load(step)
        except CheckpointException as e:
            where = self.checkpoint_dir(step) if step != -1 else self.initial_load_path
            raise load_failure(e, str(where)) from None


def check_checkpoint_folder(config, layout: Layout | None = None) -> None:
    """Before ranks spawn: the checkpoint the run would resume from is readable and
    verifies (sizes; checksums too with checkpoint.verify_before_launch), and was saved
    on `layout` (if known). Raises CheckpointIntegrityError with one line naming the
    file and step."""
    ck = config.checkpoint
    if not ck.enable or ck.create_seed_checkpoint:
        return
    folder = Path(config.dump_folder) / ck.folder
    check = lambda d: verify(d, checksums=ck.verify_before_launch)
    if folder.exists():
        if not folder.is_dir() or not os.access(folder, os.R_OK | os.X_OK):
            raise CheckpointIntegrityError(f"checkpoint folder {folder} is not a readable folder")
        step, _ = choose_step(
            folder,
            ck.load_step,
            fallback=ck.fallback_to_previous,
            allow_unverified=ck.allow_unverified,
            check=check,
        )
        if step != -1:
            check_layout(folder / f"step-{step}", layout, ck.reshard)
            return
    elif ck.load_step != -1:
        raise CheckpointIntegrityError(
            f"checkpoint.load_step = {ck.load_step}, but checkpoint folder {folder} does not exist"
        )
    if ck.initial_load_path and not ck.initial_load_in_hf:
        path = Path(ck.initial_load_path)
        if not path.is_dir():
            raise CheckpointIntegrityError(f"checkpoint.initial_load_path {path} is not a folder")
        if (path / MANIFEST).exists():
            check(path)
