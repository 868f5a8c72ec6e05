"""``atlasfs pack``: any dataset atlasfs mounts, written as an Atlas v1 dataset whose mount
shows the same files byte for byte.

Samples are taken as the source's mount shows them (:mod:`.packexamples`) and written by
the Atlas writer's shard writer (:class:`~atlasfs.formats.atlas.writer.ShardWriter`) with
the reference writer's rules: strategies 0-3, a dictionary trained per shard (3) or on the
first shard and shared (2), strategy 1 where a shard has fewer than 7 blocks (under 2 the
whole dataset's, when the first shard does), index dtype by size, shard folders padded to
the width of the last one's number. By default each source shard becomes one Atlas shard
(in order: Atlas shard ``i`` is the source's ``i``-th); ``shard_size`` cuts the samples into
shards of that many instead.

The write goes to ``.<OUTDIR name>.pack-partial`` beside OUTDIR, renamed to OUTDIR once
complete: OUTDIR never holds half a dataset. Each shard is written to ``<name>.partial``
inside it and renamed when complete, so a run that is killed or stops on a bad source
shard leaves the shards it finished; a later run with the same source and settings
(``pack.json`` records them) keeps them and writes only the others, any other run starts
afresh. Shards are written by ``jobs`` processes at once, or by Ray tasks (``jobs`` a
:class:`~atlasfs.commands.jobs.Executor`). Under strategy 2 the shared dictionary is trained
first, by one worker, on the first shard's blocks as its writer would (the reference
writer's rule), kept in the folder and handed to every worker with the rest of what it
needs: no shard is written before it, every shard is written at once after it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import pickle
import shutil
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import zstandard

from atlasfs.commands.jobs import Executor, Pool, executor_of, said_once
from atlasfs.commands.packexamples import ExampleMaker, PackError, shard_samples
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas.dataset import DICT_NAME
from atlasfs.formats.atlas.meta import FORMAT_VERSION, CompressionStrategy, RootMeta, ShardMeta
from atlasfs.formats.atlas.writer import (MIN_BLOCKS_FOR_DICTIONARY, PICKLE_PROTOCOL, ShardWriter,
                                          _train_dictionary, shard_name_width)
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.formats.naming import index_key_width
from atlasfs.storage import StorageOptions, set_default_options
from atlasfs.tree.blocktree import BlockTree

#: What a leftover temporary folder's ``pack.json`` must say for its shards to be kept.
PACK_VERSION = 1
PARTIAL = ".partial"
#: Bytes of decoded blocks each process caches while packing.
PACK_CACHE_BYTES = 64 << 20

__all__ = ["PackError", "PackReport", "PackSettings", "finished_shards", "pack", "temporary_folder"]


@dataclass(frozen=True)
class PackSettings:
    """How the Atlas dataset is written (the reference writer's parameters, plus ``decode``)."""

    #: Examples per shard; None: one Atlas shard per source shard.
    shard_size: int | None = None
    block_size: int = 64
    strategy: int = int(CompressionStrategy.SHARED_DICTIONARY_COMPRESSION)
    level: int = 3
    dict_size: float = 0.01
    #: Fields with a webdataset default decoder hold decoded values where they round trip.
    decode: bool = False

    def check(self) -> None:
        """Raise :class:`PackError` for a setting the writer would refuse."""
        if self.shard_size is not None and self.shard_size < 1:
            raise PackError("--shard-size must be at least 1")
        if self.block_size < 1:
            raise PackError("--block-size must be at least 1")
        if self.strategy not in range(4):
            raise PackError("--strategy must be 0, 1, 2 or 3")
        if not 0.0 <= self.dict_size <= 1.0:
            raise PackError("--dict-size must be between 0 and 1 (a fraction of a shard's bytes)")
        if not -(1 << 17) <= self.level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise PackError(f"--level must be at most {zstandard.MAX_COMPRESSION_LEVEL}")


@dataclass(frozen=True)
class _Context:
    """What a worker process needs to open the source and write shards (picklable)."""

    dataset: str
    kind: str | None
    options: SourceOptions
    storage: StorageOptions
    settings: PackSettings
    folder: str
    width: int = 6
    #: The shared dictionary (strategy 2), trained before any shard is written.
    shared: bytes | None = None


@dataclass(frozen=True)
class _Job:
    """One Atlas shard to write: its folder name and the source samples it holds,
    ``(source shard position, start, stop)`` pieces, the first at global ``first_index``."""

    name: str
    pieces: tuple[tuple[int, int, int], ...]
    first_index: int
    strategy: int


@dataclass
class PackReport:
    """What a pack wrote."""

    path: str
    shards: int = 0
    examples: int = 0
    strategy: int = 0
    reused: int = 0
    kept: Counter[str] = field(default_factory=Counter)
    #: Why shards were written with another strategy than asked (one line), or None.
    fallback: str | None = None


_worker: dict[str, Any] = {}


def _start(context: _Context, in_pool: bool = False) -> None:
    """Open the source in this process (a pool's initializer, or the parent with one job)."""
    if in_pool:
        logger = logging.getLogger("atlasfs")
        if not logger.handlers:  # what the source notes (a member left out) is said as the parent says it
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("atlasfs: %(message)s"))
            logger.addHandler(handler)
    set_default_options(context.storage)
    source = open_source(context.dataset, context.kind, context.options)
    _worker.update(context=context, source=source,
                   tree=BlockTree(source, cache_bytes=PACK_CACHE_BYTES, log_failures=False))


def _stop() -> None:
    source = _worker.pop("source", None)
    if source is not None:
        source.close()
    _worker.clear()


def _shard_name(s: int) -> str:
    return _worker["tree"].shards[s].name


def _count(s: int) -> int:
    """Samples of source shard position ``s`` (its pass over its files, if it needs one)."""
    shard = _worker["tree"].shards[s]
    try:
        if shard.error is not None:
            raise shard.error
        shard.prepare()
        return sum(shard.block_length(b) for b in range(shard.num_blocks))
    except (AtlasFormatError, OSError) as exc:
        raise PackError(f"source shard {shard.name} cannot be read: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    return getattr(exc, "cause", None) or (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))


def _write(job: _Job) -> tuple[str, int, Counter[str]]:
    """Write one Atlas shard (into ``<name>.partial``, renamed when complete)."""
    context: _Context = _worker["context"]
    settings = context.settings
    final = os.path.join(context.folder, job.name)
    partial = final + PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    shared = None
    if job.strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
        shared = zstandard.ZstdCompressionDict(context.shared)
    writer = ShardWriter(partial, settings.block_size, CompressionStrategy(job.strategy), settings.level,
                         settings.dict_size, shared)
    maker = ExampleMaker(context.width, settings.decode)
    index = job.first_index
    s = -1
    try:
        for s, start, stop in job.pieces:
            where = f"source shard {_shard_name(s)}"
            before = index
            for key, files in shard_samples(_worker["tree"], s, start, stop):
                writer.add(maker.make(key, files, index, where))
                index += 1
            if index - before != stop - start:
                raise PackError(f"{where}: {index - before} samples where {stop - start} were counted "
                                "(did it change while packing?)")
        meta = writer.close()
    except PackError:
        writer.abort()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except (AtlasFormatError, OSError) as exc:  # Unreadable names the shard or block and what is wrong
        writer.abort()
        shutil.rmtree(partial, ignore_errors=True)
        raise PackError(f"source shard {_shard_name(s)} cannot be read: {_why(exc)}") from None
    except BaseException:
        writer.abort()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    with open(os.path.join(partial, "meta.json"), "w") as f:
        f.write(meta.to_json())
    os.rename(partial, final)
    return job.name, meta.stored_examples, maker.kept


def _replace_file(path: str, data: bytes) -> None:
    with open(path + PARTIAL, "wb") as f:
        f.write(data)
    os.replace(path + PARTIAL, path)


def temporary_folder(outdir: str) -> str:
    """Where ``pack`` writes before renaming to ``outdir``: a hidden folder beside it."""
    parent, name = os.path.split(os.path.abspath(outdir))
    return os.path.join(parent, f".{name}.pack-partial")


def resumable(folder: str) -> bool:
    """Whether the temporary folder ``folder`` is there for a next run: a folder (not a link)
    of this user's (another's is never used: :func:`_own_folder`)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def finished_shards(folder: str) -> int:
    """Shards completed in the temporary folder ``folder`` (kept for the next run)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    return sum(os.path.isfile(os.path.join(folder, name, "meta.json")) for name in names)


def _own_folder(path: str) -> int:
    """A descriptor of the folder ``path``, made if missing, once found to be a folder of this
    user's that no one else can write. It sits beside OUTDIR, often in a shared /tmp, under a
    name anyone can foresee: another user's link there had pack empty the folder it points
    to (every entry removed as a leftover) and write the dataset into it, and another user's
    folder would have become OUTDIR, theirs to change (or to fill beforehand with shards and a
    pack.json that this run would keep). Never followed, never used: :class:`PackError`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if os.path.islink(path):
            raise PackError(f"{path}: is a symbolic link (never followed); remove it, or pack elsewhere") from None
        raise
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():  # its mode is this user's umask, as OUTDIR's would be
        os.close(fd)
        raise PackError(f"{path}: not used: it is owned by uid {owner}, not by this user; remove it, or pack elsewhere")
    return fd


class _Folder:
    """The temporary folder, locked while a pack writes in it, its leftover shards kept
    if ``pack.json`` says they were written from the same source with the same settings."""

    def __init__(self, path: str, signature: dict[str, Any]) -> None:
        self.path = path
        self._fd = _own_folder(path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise PackError(f"{path}: another atlasfs pack is writing there") from None
        record = os.path.join(path, "pack.json")
        try:
            with open(record) as f:
                same = json.load(f) == signature
        except (OSError, ValueError):
            same = False
        for name in os.listdir(path):  # shards half written, or everything of another pack
            if not same or name.endswith(PARTIAL):
                target = os.path.join(path, name)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
        if not same:
            _replace_file(record, json.dumps(signature).encode())

    def done(self, name: str) -> bool:
        """Whether shard folder ``name`` was completed (by this run or a killed one)."""
        return os.path.isfile(os.path.join(self.path, name, "meta.json"))

    def meta(self, name: str) -> dict[str, Any]:
        with open(os.path.join(self.path, name, "meta.json")) as f:
            return json.load(f)

    def finish(self, outdir: str) -> None:
        """Rename the folder to ``outdir`` (which must still not exist)."""
        os.unlink(os.path.join(self.path, "pack.json"))
        if os.path.lexists(outdir):  # rename(2) would replace an empty folder
            raise PackError(f"{outdir}: appeared while the dataset was being written")
        os.rename(self.path, outdir)

    def remove_partials(self) -> None:
        """Remove what a stopped worker left half written (the next run would)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                if name.endswith(PARTIAL):
                    target = os.path.join(self.path, name)
                    if os.path.isdir(target) and not os.path.islink(target):
                        shutil.rmtree(target, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(target)

    def close(self, keep_if_any: bool = False) -> None:
        """Unlock; with ``keep_if_any`` (a pack that stopped) remove the folder unless it
        holds a finished shard for the next run."""
        if self._fd < 0:
            return
        if keep_if_any and os.path.isdir(self.path) and not any(
                os.path.isfile(os.path.join(self.path, name, "meta.json")) for name in os.listdir(self.path)):
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1


def _plan(counts: Sequence[int], shard_size: int | None) -> list[list[tuple[int, int, int]]]:
    """The pieces of each Atlas shard: one per source shard, or cut every ``shard_size`` samples."""
    if shard_size is None:
        return [[(s, 0, n)] for s, n in enumerate(counts)] or [[]]
    shards: list[list[tuple[int, int, int]]] = [[]]
    room = shard_size
    for s, n in enumerate(counts):
        start = 0
        while start < n:
            if room == 0:
                shards.append([])
                room = shard_size
            take = min(room, n - start)
            shards[-1].append((s, start, start + take))
            start += take
            room -= take
    return shards


class _Runner:
    """Runs ``items`` jobs in this process (one job) or on an executor's workers."""

    def __init__(self, context: _Context, jobs: int | Executor, items: int) -> None:
        self.pool: Pool | None = None
        executor = executor_of(jobs)
        if executor.parallel(items):
            self.pool = executor.pool(items, _start, (context, True))
        else:
            _start(context)

    def map(self, func: Callable[[Any], Any], items: Iterable[Any], each: Callable[[Any], None]) -> None:
        """``func`` of every item; ``each`` of every result as it comes. The first failure
        gives out no more items and is raised once the running ones end (their shards are
        kept). Interrupted, the workers are stopped at once (:meth:`close`)."""
        if self.pool is None:
            for item in items:
                with said_once() as held:  # a damaged source is then the failure's line only, as in workers
                    try:
                        result = func(item)
                    except BaseException as exc:
                        held.answered(exc)
                        raise
                each(result)
            return
        todo = collections.deque(items)
        failure: BaseException | None = None
        while True:
            while todo and failure is None and self.pool.idle():
                item = todo.popleft()
                self.pool.submit(item, func, item)
            if not self.pool.busy():
                break
            for item, kind, value in self.pool.wait():
                if kind == "ok":
                    each(value)
                elif failure is None:
                    failure = value if kind == "error" else PackError(
                        f"a worker process ended without a result while packing {_what(item)} "
                        "(killed, or out of memory?)")
        if failure is not None:
            raise failure

    def close(self, interrupted: bool = False) -> None:
        """Let the workers end, or with ``interrupted`` stop them now; in this process, close the source."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            if interrupted:
                pool.stop()
            else:
                pool.close()
        else:
            _stop()


def _what(item: Any) -> str:
    return f"shard {item.name}" if isinstance(item, _Job) else f"source shard position {item}"


def pack(dataset: str, outdir: str, settings: PackSettings, kind: str | None = None,
         options: SourceOptions | None = None, storage: StorageOptions | None = None, jobs: int | Executor = 1,
         progress: Callable[[int], Any] | None = None, report: PackReport | None = None) -> PackReport:
    """Write ``dataset`` (any format atlasfs mounts) as an Atlas dataset at ``outdir``.

    ``progress(total)`` is called once with the number of shards and returns a callable
    called once per shard written (``tqdm(total=...).update`` fits). Raises
    :class:`PackError` saying why a pack stops (the shards finished are kept for the next run).
    ``report`` (if given) is filled and returned: its ``shards`` are known once the source's
    samples are counted (an interrupted pack's total). Interrupted (KeyboardInterrupt), the
    workers are stopped at once and the shards finished kept.
    """
    settings.check()
    outdir = os.path.abspath(outdir)
    if os.path.lexists(outdir):
        raise PackError(f"{outdir}: already exists (pack writes a new dataset there)")
    if not os.path.isdir(os.path.dirname(outdir)):
        raise PackError(f"{os.path.dirname(outdir)}: no such folder (OUTDIR's parent must exist)")
    options = options or SourceOptions()
    storage = storage or StorageOptions()
    with open_source(dataset, kind, options) as source:
        kind = source.kind
        shards = [shard.name for shard in source.shards]
        keys: list[Any] = []
        for shard in source.shards:
            try:
                keys.append(shard.table_key())
            except Exception:  # noqa: BLE001 (no signature: a leftover is never reused)
                keys.append(os.urandom(8).hex())
    signature = {"version": PACK_VERSION, "source": {"path": os.path.abspath(dataset), "kind": kind,
                                                     "options": asdict(options), "shards": keys},
                 "settings": asdict(settings)}
    folder = _Folder(temporary_folder(outdir), signature)
    context = _Context(os.fspath(dataset), kind, options, storage, settings, folder.path)
    runner: _Runner | None = None
    try:
        runner = _Runner(context, jobs, len(shards))
        counts = [0] * len(shards)

        def counted(item: tuple[int, int]) -> None:
            counts[item[0]] = item[1]
        runner.map(_count_item, range(len(shards)), counted)
        plan = _plan(counts, settings.shard_size)
        total = sum(counts)
        width = shard_name_width(len(plan))
        names = [str(i).zfill(width) for i in range(len(plan))]
        firsts = [0]
        for pieces in plan:
            firsts.append(firsts[-1] + sum(b - a for _, a, b in pieces))
        width = index_key_width(total)
        strategy, shared = settings.strategy, None
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:  # 1 if no dictionary can be trained
            strategy, shared = _shared_dictionary(runner, folder, names[0], plan[0], width)
        context = _Context(context.dataset, kind, options, storage, settings, folder.path, width, shared)
        runner.close()
        runner = None
        runner = _Runner(context, jobs, len(plan))
        report = report if report is not None else PackReport(outdir)
        report.path, report.shards, report.examples = outdir, len(plan), total
        advance = progress(len(plan)) if progress else (lambda n=1: None)

        def written(result: tuple[str, int, Counter[str]]) -> None:
            report.kept.update(result[2])
            advance(1)

        todo = []
        for i in range(len(plan)):
            if folder.done(names[i]):
                report.reused += 1
                advance(1)
            else:
                todo.append(_Job(names[i], tuple(plan[i]), firsts[i], strategy))
        runner.map(_write, todo, written)
        report.strategy = strategy if settings.strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION \
            else settings.strategy  # under 3 the root keeps 3 whatever its shards fell back to
        report.fallback = _fallback(settings, [folder.meta(name) for name in names])
        sizes = tuple(folder.meta(name)["stored_examples"] for name in names)
        root = RootMeta(FORMAT_VERSION, sizes, CompressionStrategy(report.strategy))
        with open(os.path.join(folder.path, "meta.json"), "w") as f:
            f.write(root.to_json())
        folder.finish(outdir)
        return report
    except BaseException:
        if runner is not None:
            runner.close(interrupted=True)
        folder.remove_partials()
        folder.close(keep_if_any=True)
        raise
    finally:
        if runner is not None:
            runner.close()
        folder.close()


def _fallback(settings: PackSettings, metas: list[dict[str, Any]]) -> str | None:
    """Why shards were written with strategy 1 when a dictionary was asked (2 or 3), or None.
    zstd trains a dictionary on whole blocks, at least :data:`MIN_BLOCKS_FOR_DICTIONARY` of
    them: a small shard in big blocks has too few (one tar of the demo's export: 50 samples,
    one block of 64)."""
    asked = settings.strategy
    if asked not in (CompressionStrategy.SHARED_DICTIONARY_COMPRESSION, CompressionStrategy.DICTIONARY_COMPRESSION):
        return None
    trained = metas[:1] if asked == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION else metas
    fell = [m for m in trained if m["compression_strategy"] == CompressionStrategy.STANDARD_COMPRESSION]
    if not fell:
        return None
    blocks = [-(-m["stored_examples"] // m["block_size"]) for m in fell]
    if asked == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
        head, subject = "strategy 1 used, not 2", "the first shard"
    else:
        head = f"strategy 1 used for {len(fell)} of {len(metas)} shards, not 3"
        subject = "that shard" if len(fell) == 1 else "those shards"
    if max(blocks) >= MIN_BLOCKS_FOR_DICTIONARY:
        return f"{head}: zstd could not train a dictionary on {subject}'s blocks"
    least = min(m["stored_examples"] for m in fell)  # a block size that gives each of them enough
    hint = (f" (--block-size {least // MIN_BLOCKS_FOR_DICTIONARY} or less makes {MIN_BLOCKS_FOR_DICTIONARY} blocks)"
            if least >= MIN_BLOCKS_FOR_DICTIONARY else "")
    has = f"{'has' if len(fell) == 1 else 'have at most'} {max(blocks)} block{'s' if max(blocks) > 1 else ''}"
    return f"{head}: {subject} {has}, fewer than the {MIN_BLOCKS_FOR_DICTIONARY} zstd trains a dictionary on{hint}"


def _shared_dictionary(runner: _Runner, folder: _Folder, first: str, pieces: list[tuple[int, int, int]],
                       width: int) -> tuple[int, bytes | None]:
    """Strategy 2's dictionary and the strategy the shards are written with: the one an
    earlier run of the same pack trained (kept in the folder), else one trained now on the
    first shard's blocks (:func:`_train`, by one worker) and kept in the folder before any
    shard is written; strategy 1 and no dictionary where none can be trained."""
    path = os.path.join(folder.path, DICT_NAME)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return CompressionStrategy.SHARED_DICTIONARY_COMPRESSION, f.read()
    if folder.done(first):  # written without one by an earlier run: none could be trained
        return folder.meta(first)["compression_strategy"], None
    trained: list[bytes | None] = []
    runner.map(_train, [(tuple(pieces), width)], trained.append)
    if trained[0] is None:
        return CompressionStrategy.STANDARD_COMPRESSION, None
    _replace_file(path, trained[0])
    return CompressionStrategy.SHARED_DICTIONARY_COMPRESSION, trained[0]


def _train(item: tuple[tuple[tuple[int, int, int], ...], int]) -> bytes | None:
    """The dictionary the first shard's writer would train (strategy 3's): on its blocks,
    made from its samples as :func:`_write` makes them; None if zstd trains none."""
    pieces, width = item
    settings: PackSettings = _worker["context"].settings
    maker = ExampleMaker(width, settings.decode)
    blocks: list[bytes] = []
    block: list[Any] = []
    index, s = 0, -1
    try:
        for s, start, stop in pieces:
            where = f"source shard {_shard_name(s)}"
            for key, files in shard_samples(_worker["tree"], s, start, stop):
                block.append(maker.make(key, files, index, where))
                index += 1
                if len(block) == settings.block_size:
                    blocks.append(pickle.dumps(block, protocol=PICKLE_PROTOCOL))
                    block = []
    except (AtlasFormatError, OSError) as exc:
        raise PackError(f"source shard {_shard_name(s)} cannot be read: {_why(exc)}") from None
    if block:
        blocks.append(pickle.dumps(block, protocol=PICKLE_PROTOCOL))
    trained = _train_dictionary(blocks, settings.dict_size, settings.level)
    return None if trained is None else trained.as_bytes()


def _count_item(s: int) -> tuple[int, int]:
    return s, _count(s)
