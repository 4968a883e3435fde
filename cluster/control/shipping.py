"""What a node is sent when it cannot read the bundle (no shared filesystem): the ship path.

A `Shipment` is the bundle's small files (bundle.json, graph.json, kernels.*, ops.json) and a
safetensors *slice*: a weights file holding only the tensors of the stages placed on that node,
built by reading exactly those tensors from the bundle (each verified against bundle.json's
sha256 as it is read). It is sent once per node, not once per actor: the Ray launcher puts one
object per node and every stage actor there takes the same one; the first to unpack it writes it
to a per-node directory named by the slice's digest, the others reuse it. The worker loads the
unpacked bundle with `partial_weights=True`: bundle.json still carries every tensor's checksum, so
integrity is checked per tensor when a stage reads it, never by re-hashing a whole file.

Bundles whose weights are not safetensors (npz, legacy .params, generated) are shipped whole,
as before: they cannot be read by tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from tvmpipe.bundle import Bundle, load_bundle
from tvmpipe.bundle.weights import LazyParams, safetensors_header
from tvmpipe.cluster.worker import LocalBundle

DONE = ".complete"  # written last into an unpacked shipment directory
SHIP_PREFIX = "tvmpipe-ship-"  # unpacked shipments: <tmp>/tvmpipe-ship-<key> and its lock file <...>.lock


@dataclass
class Shipment:
    files: dict[str, bytes]  # every bundle file except the weights file
    weights_name: str | None = None  # the weights file's name in bundle.json (None: shipped whole in files)
    weights: np.ndarray | None = None  # uint8: a safetensors file with only `tensors`
    tensors: tuple[str, ...] = ()
    key: str = ""  # digest of the small files and the slice's checksums: one unpacked copy per node
    partial: bool = True
    stages: tuple[int, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        """Every byte sent: small files and the weights slice (header included)."""
        return sum(len(b) for b in self.files.values()) + (0 if self.weights is None else int(self.weights.nbytes))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights slice (its header included); 0 when the weights were shipped whole."""
        return 0 if self.weights is None else int(self.weights.nbytes)


def stage_param_names(bundle: Bundle, start: int, end: int) -> list[str]:
    """The params nodes [start, end) read, in bundle order (the graph alone: no data read)."""
    g = bundle.graph
    params = set(bundle.param_names)
    used = set()
    for node in g.nodes[start:end]:
        for inp in node.inputs:
            name = g.nodes[inp.node].name
            if name in params:
                used.add(name)
    return [n for n in bundle.param_names if n in used]


def bundle_files(path: str | Path) -> list[tuple[str, Path]]:
    """A bundle directory's files by their names inside it ('tokenizer/tokenizer.json' for one in a
    subdirectory), in a fixed order; a bare graph.json alone."""
    path = Path(path)
    if path.is_file():
        return [(path.name, path)]
    return [(p.relative_to(path).as_posix(), p) for p in sorted(path.rglob("*")) if p.is_file()]


def whole_files(path: str | Path) -> dict[str, bytes]:
    """A bundle directory's (or bare graph's) files as bytes: the legacy ship path."""
    return {name: p.read_bytes() for name, p in bundle_files(path)}


def build_shipment(bundle: Bundle | str | Path, stages: Iterable[tuple[int, int]], indices: Iterable[int] = ()) -> Shipment:
    """The shipment for the stages (node ranges) placed on one node: only their tensors are read."""
    if not isinstance(bundle, Bundle) and not _streams(Path(bundle)):  # never load (or generate) what goes whole
        return _whole(Path(bundle), indices)
    bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    path = Path(bundle.path)
    m = bundle.manifest
    if m is None or not m.streams_params or not isinstance(bundle.params, LazyParams):
        return _whole(path, indices)
    wanted: set[str] = set()
    for start, end in stages:
        wanted.update(stage_param_names(bundle, start, end))
    names = [n for n in bundle.param_names if n in wanted]
    lazy = bundle.params
    infos = [lazy.info(n) for n in names]
    head, rel, total = safetensors_header([(t.name, t.dtype, t.shape) for t in infos],
                                          {"tvmpipe.slice_of": m.params_file})
    buf = np.empty(len(head) + total, np.uint8)
    buf[:len(head)] = np.frombuffer(head, np.uint8)
    for n in names:  # exactly these tensors are read (and verified) from the bundle
        r = rel[n]
        lazy.read_into(n, buf[len(head) + r.begin:len(head) + r.end])
    files = {name: p.read_bytes() for name, p in bundle_files(path) if name != m.params_file}
    sums = m.params_sha256 or {}
    key = _digest([hashlib.sha256(files[f]).hexdigest() for f in sorted(files)] + [f"{n}:{sums.get(n, '')}" for n in names])
    return Shipment(files=files, weights_name=m.params_file, weights=buf, tensors=tuple(names), key=key,
                    stages=tuple(indices))


def _streams(path: Path) -> bool:
    """Whether a bundle directory's weights are a safetensors file (bundle.json peeked, nothing loaded)."""
    import json

    try:
        obj = json.loads((path / "bundle.json").read_text())
        return str((obj.get("params") or {}).get("file") or "").endswith(".safetensors")
    except (OSError, ValueError, AttributeError):
        return False


def _whole(path: Path, indices: Iterable[int]) -> Shipment:
    return Shipment(files=whole_files(path), partial=False, stages=tuple(indices), key=_digest([whole_files_digest(path)]))


def whole_files_digest(path: Path) -> str:
    h = hashlib.sha256()
    for name, p in bundle_files(path):
        h.update(name.encode())
        h.update(str(p.stat().st_size).encode())
        h.update(str(p.stat().st_mtime_ns).encode())
    return h.hexdigest()


def _write(root: Path, name: str, data: bytes) -> None:
    """One shipped file under `root`, its subdirectory made first; a name that would leave `root`
    (absolute, or through '..') is refused: it came from the driver, but a bug there must not write
    outside the node's copy."""
    target = (root / name).resolve()
    if Path(name).is_absolute() or ".." in Path(name).parts or root.resolve() not in target.parents:
        raise ValueError(f"shipped file name {name!r} is not inside the bundle")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@dataclass
class Lease:
    """This process's use of an unpacked shipment directory on its node.

    Every process using the directory holds a shared `flock` on its lock file (`<dir>.lock`) for
    as long as it uses it; the kernel drops the lock when the process dies, however it dies. Whoever
    then finds the lock free for an exclusive hold (the last user at `release`, or any later
    `unpack` on the node, which sweeps) removes the directory: a SIGKILLed actor's gigabytes of
    weights do not outlive the run, and a restarted actor that reused its predecessor's copy still
    cleans it up."""

    directory: Path
    fd: int | None

    def release(self) -> None:
        """Stop using the directory; remove it if no other process uses it. Idempotent."""
        if self.fd is None:
            return
        os.close(self.fd)  # drops this process's shared lock
        self.fd = None
        _remove_if_unused(self.directory)


@dataclass
class Unpacked:
    path: str  # the bundle (a directory, or a bare graph.json)
    partial: bool  # the weights file holds only this node's stages' tensors
    lease: Lease


def _lock_path(directory: Path) -> Path:
    return directory.with_name(directory.name + ".lock")


def _locked(directory: Path, mode: int) -> int | None:
    """An fd holding `mode` (fcntl.LOCK_SH or LOCK_EX, maybe | LOCK_NB) on `directory`'s lock file,
    or None when a non-blocking lock is taken. Retries when the file was replaced while waiting
    (a remover unlinks it): the lock must be on the file the path names now."""
    import fcntl

    lock = _lock_path(directory)
    while True:
        try:  # read-only is enough for flock: another user's workers can share a shipment's lock
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            if mode & fcntl.LOCK_NB:
                return None  # not ours to sweep
            raise
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _remove_if_unused(directory: Path) -> bool:
    """Remove `directory` (and the temporary directories of an unpack that died part-way) when no
    process holds its lock; True if removed."""
    import fcntl

    fd = _locked(directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return False
    try:
        shutil.rmtree(directory, ignore_errors=True)
        for part in directory.parent.glob(f".{directory.name}-*"):
            shutil.rmtree(part, ignore_errors=True)
        with contextlib.suppress(OSError):  # another user's (sticky /tmp): it sweeps its own
            _lock_path(directory).unlink(missing_ok=True)  # while still held: a waiter re-opens (_locked)
    finally:
        os.close(fd)
    return not directory.exists()


def sweep_unused(root: str | Path | None = None) -> list[Path]:
    """Remove every shipment directory on this node that no live process uses (left by processes
    that were killed). Returns those removed."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for lock in root.glob(f"{SHIP_PREFIX}*.lock"):
        directory = lock.with_name(lock.name[:-len(".lock")])
        if _remove_if_unused(directory):
            removed.append(directory)
    return removed


def local_bundle(shipment: list | None, stage: int) -> LocalBundle | None:
    """What a launcher hands its stage worker: None (the worker reads the bundle path in place), or
    this node's unpacked, leased copy of `shipment` ([a Shipment or a dict of files]: taken out of
    the list, so that once it is written to disk this process holds no copy in memory)."""
    if not shipment:
        return None
    files = shipment.pop()
    sent = files.nbytes if isinstance(files, Shipment) else sum(len(b) for b in files.values())
    unpacked = unpack(files, f"stage{stage}")
    del files
    return LocalBundle(unpacked.path, unpacked.partial, sent, unpacked.lease.release)


def unpack(shipment: Shipment | dict[str, bytes], owner: str) -> Unpacked:
    """Write a shipment where this node's workers find it, and lease it (`Lease`: release it when
    done). A shipment already unpacked on this node (by another stage actor) is reused, not written
    again. Directories that no live process uses any more are swept first."""
    import fcntl

    sweep_unused()
    if isinstance(shipment, dict):  # legacy: every file, one private copy
        final = Path(tempfile.gettempdir(), f"{SHIP_PREFIX}{owner}-{secrets.token_hex(8)}")
        fd = _locked(final, fcntl.LOCK_SH)  # before the directory exists: a sweep never sees it unlocked
        final.mkdir(mode=0o700)
        for name, data in shipment.items():
            _write(final, name, data)
        path = str(final) if len(shipment) > 1 else str(Path(final, next(iter(shipment))))
        return Unpacked(path, False, Lease(final, fd))
    final = Path(tempfile.gettempdir(), f"{SHIP_PREFIX}{shipment.key}")
    # a bare graph.json shipped alone is loaded as the file, a bundle as its directory
    where = str(final / next(iter(shipment.files))) if shipment.weights is None and len(shipment.files) == 1 else str(final)
    fd = _locked(final, fcntl.LOCK_SH)  # held from here: no sweep removes what this process unpacks or uses
    lease = Lease(final, fd)
    if (final / DONE).is_file():
        return Unpacked(where, shipment.partial, lease)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        for name, data in shipment.files.items():
            _write(tmp, name, data)
        if shipment.weights is not None:
            with open(tmp / shipment.weights_name, "wb") as f:
                mv = memoryview(shipment.weights)
                for off in range(0, len(mv), 64 << 20):
                    f.write(mv[off:off + (64 << 20)])
        (tmp / DONE).write_text(owner)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # another actor on this node got there first
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / DONE).is_file():
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        lease.release()
        raise
    return Unpacked(where, shipment.partial, lease)
