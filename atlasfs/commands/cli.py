"""The ``atlasfs`` command line.

Ctrl-C or SIGTERM in ``pack``, ``export``, ``index`` or ``verify``: status 130 within 2 s,
one line saying what was kept (:mod:`atlasfs.commands.interrupts`). The modules of the
commands are imported once :func:`main` handles those signals, so that one arriving
while they load is that line too, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from atlasfs import __version__
from atlasfs.commands import interrupts
from atlasfs.commands.interrupts import Interrupted
from atlasfs.errors import AtlasFormatError

if TYPE_CHECKING:
    from tqdm import tqdm

    from atlasfs.commands.jobs import Executor, Opener
    from atlasfs.formats.source import Source
    from atlasfs.options import MountOptions

#: The commands that stop on Ctrl-C or SIGTERM as :mod:`~atlasfs.commands.interrupts` says
#: (the others keep Python's handling: mount has its own).
INTERRUPTIBLE = ("pack", "export", "index", "verify")

log = logging.getLogger("atlasfs")


class UsageError(Exception):
    """Bad arguments, reported as one line."""


def _source(args: argparse.Namespace) -> Source:
    """The dataset as a source, as a mount would open it."""
    from atlasfs.formats.factory import open_source
    return open_source(args.dataset, args.settings.format, args.settings.source_options())


def cmd_info(args: argparse.Namespace) -> int:
    from atlasfs.commands.inspection import info_lines
    with _source(args) as source:  # a shard that cannot be read is one row; the others are summed up
        lines, problems = info_lines(source)
    print("\n".join(lines))
    return 1 if problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from atlasfs.commands.inspection import VerifyReport, verify
    from atlasfs.commands.shardverify import verifier
    verify = verifier(args, verify)  # --ray: a task per shard
    from atlasfs.progress import progress_bar
    progress: tqdm | None = None

    def on_total(total: int) -> None:
        nonlocal progress
        progress = progress_bar("verify", total, "blocks", args.quiet)

    on_block = lambda: progress.update(1) if progress else None  # noqa: E731
    report = VerifyReport()

    def status() -> str:
        found = (f"{len(report.problems)} problem(s) found so far" if report.problems
                 else "no problem found so far")
        if not report.total:  # the dataset was still being opened: no count to give yet
            return f"verify interrupted while opening the dataset: {found}"
        return f"verify interrupted after {report.shards} of {report.total} shards: {found}"
    interrupts.set_status(status)
    try:  # a folder of no known format is verify's finding too, on stdout like the others
        verify(lambda: _source(args), on_total=on_total, on_block=on_block, report=report)
    except KeyboardInterrupt:
        if progress:
            progress.close()
        for line in report.problems:  # what was found so far is said
            print(line)
        raise Interrupted(status() + (" (above)" if report.problems else "")) from None
    if progress:
        progress.close()
    for line in report.warnings:
        print(f"warning: {line}")
    for line in report.problems:
        print(line)
    counts = f"{report.shards} shards, {report.blocks} blocks, {report.examples} examples"
    if report.problems:
        print(f"verify: {len(report.problems)} problem(s) ({counts} checked)")
        return 1
    if not args.quiet:
        print(f"verify: OK ({counts})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from atlasfs.commands.inspection import describe, locate
    args.settings.lenient = True  # any example whose block is intact shows, also in a damaged shard
    with _source(args) as source:
        try:
            shard, block, pos, index = locate(source, args.index)
        except IndexError as exc:
            raise UsageError(str(exc)) from None
        example = shard.decode_block(block)[0][pos]
        print(f"example {index} (shard {shard.name}, block {block}, position {pos})")
        print("\n".join(describe(example)))
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from atlasfs.fuse.mount import MountError, mount
    options: MountOptions = args.settings
    options.foreground = args.foreground
    _outside_dataset(args.mountpoint, args.dataset, "a mount point goes outside the dataset: choose another")
    if options.index_dir is not None:  # else its first table is a log line in the daemon's log, the mount "fine"
        _writable_index_dir(options.index_dir, shared_ok=True)
    try:
        return mount(args.dataset, args.mountpoint, options)
    except MountError as exc:  # the dataset's opening failed as such (its message), or another check
        hint = _shard_folder_hint(args.dataset, "mount")
        if hint:
            raise MountError(f"{exc}{hint}") from None
        raise


def cmd_umount(args: argparse.Namespace) -> int:
    from atlasfs.fuse.mount import unmount
    unmount(args.mountpoint, lazy=args.lazy)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from atlasfs.commands.export import Exported, export_all, write_index
    from atlasfs.tree.tarview import INDEX_NAME
    result = Exported()
    asked: list[int] = []
    index = {"written": False}

    def status() -> str:
        tars = (f"{len(result.samples)} of {len(asked)} tars written in {args.outdir}" if asked
                else "no tar written")
        if index["written"]:
            return f"{tars}, {INDEX_NAME} written"
        return f"{tars}, {INDEX_NAME} not written; run the same command again to write them all"
    interrupts.set_status(status)
    try:
        return _export(args, export_all, write_index, result, asked, index)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: {status()}") from None


def _export(args: argparse.Namespace, export_all: Callable, write_index: Callable, result: Any,
            asked: list[int], index: dict[str, bool]) -> int:
    from atlasfs.progress import duration
    from atlasfs.sizes import format_size
    started = time.monotonic()
    with _source(args) as source:
        names = [s.name for s in source.shards]
        chosen = args.shards or names
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise UsageError(f"no shard named {unknown[0]!r} in {args.dataset} (shards: {', '.join(names)})")
        _outside_dataset(args.outdir, args.dataset, "the tars go outside it: choose another OUTDIR")
        if os.path.lexists(args.outdir) and not os.path.isdir(args.outdir):
            raise UsageError(f"{args.outdir}: exists and is not a folder (OUTDIR is the folder the tars go in)")
        os.makedirs(args.outdir, exist_ok=True)
        # A bad shard or block fails its own tar (not written: a tar missing samples is no
        # shard) and is named once, in export's words; the others are written.
        position = {n: s for s, n in enumerate(names)}
        positions = [position[n] for n in dict.fromkeys(chosen)]
        asked.extend(positions)
        result = export_all(source, _opener(args), positions, args.outdir, args.settings.cache_bytes, _jobs(args),
                            result, verbose=args.verbose, quiet=args.quiet)
        if result.written:
            path = write_index(args.outdir, result.written)
            index["written"] = True
            if not args.quiet:
                samples = sum(n for _, n in result.written)
                print(f"exported {len(result.written)} shards ({samples} samples, {format_size(result.size)}) "
                      f"to {args.outdir} in {duration(time.monotonic() - started)}; wids index: {path}")
        if result.failed:
            print(f"atlasfs: {result.failed} of {len(positions)} shards not written (named above)", file=sys.stderr)
        return 1 if result.failed else 0


def _outside_dataset(path: str, dataset: str, why: str) -> None:
    """:class:`UsageError` if the local ``path`` is the dataset or inside it (its new files
    would become part of what is read: tars among an export's shards, a mount over its folders)."""
    from atlasfs.storage import is_url
    if is_url(dataset) or is_url(path):
        return
    root = os.path.realpath(dataset)
    if not os.path.isdir(root):  # a dataset that is one file (a .tar, a .pbin) holds no folder
        return
    where = os.path.realpath(path)
    if where == root or where.startswith(root.rstrip(os.sep) + os.sep):
        raise UsageError(f"{path}: inside the dataset {dataset}; {why}")


def _writable_index_dir(folder: str, shared_ok: bool = False) -> None:
    """Make the folder of file tables (and its parents) if missing; :class:`UsageError` if it
    cannot be made or written. With ``shared_ok`` (a mount) an existing folder this user may
    only read passes: it holds tables another user stored for everyone (docs/reliability.md)."""
    from atlasfs.tree.table.store import make_shared_folder
    if shared_ok and os.path.isdir(folder) and os.access(folder, os.R_OK | os.X_OK):
        return
    try:
        make_shared_folder(folder)
    except OSError as exc:
        raise UsageError(f"{folder}: cannot create it ({exc.strerror}); "
                         "choose a writable folder with --index-dir DIR") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{folder}: not writable; choose a writable folder with --index-dir DIR")


def _shard_folder_hint(dataset: str, command: str) -> str:
    """``"; DS/0 is a shard folder of the dataset DS: mount DS"`` when the dataset given is one
    shard of the folder holding it (an Atlas shard's meta.json is no dataset's), else ``""``."""
    from atlasfs.formats.factory import SourceOptions, open_source
    from atlasfs.storage import is_url
    if is_url(dataset):
        return ""
    given = dataset.rstrip(os.sep) or dataset
    parent, name = os.path.dirname(given) or os.curdir, os.path.basename(given)
    if not os.path.isdir(parent) or os.path.realpath(parent) == os.path.realpath(given):
        return ""
    quiet = logging.getLogger("atlasfs")
    level, quiet.level = quiet.level, logging.CRITICAL  # what the parent's opening finds is not the user's question
    try:
        with open_source(parent, None, SourceOptions()) as source:
            shards = {shard.name for shard in source.shards}
    except Exception:  # noqa: BLE001 (no dataset there either: no hint)
        return ""
    finally:
        quiet.setLevel(level)
    return f"; {given} is a shard folder of the dataset {parent}: {command} {parent}" if name in shards else ""


def _opener(args: argparse.Namespace) -> "Opener":
    """How a worker process opens the dataset: as this command line did."""
    from atlasfs.commands.jobs import Opener
    settings: MountOptions = args.settings
    return Opener(args.dataset, settings.format, settings.source_options(), settings.storage, bool(args.verbose))


def _jobs(args: argparse.Namespace) -> int | Executor:
    from atlasfs.commands.jobs import default_jobs, executor_from_args
    return executor_from_args(args, args.settings.jobs) or args.settings.jobs or default_jobs()


def cmd_pack(args: argparse.Namespace) -> int:
    from atlasfs.commands.pack import PackError, PackReport, PackSettings, finished_shards, pack, temporary_folder
    from atlasfs.progress import progress_bar
    settings = PackSettings(args.shard_size, args.block_size, args.strategy, args.level, args.dict_size, args.decode)
    _outside_dataset(args.outdir, args.dataset, "pack writes a new dataset outside it: choose another OUTDIR")
    bar: list[tqdm] = []
    report = PackReport(os.path.abspath(args.outdir))

    def status() -> str:
        kept = temporary_folder(args.outdir)
        done = finished_shards(kept)
        of = f" of {report.shards}" if report.shards else ""
        if done:
            return f"{done}{of} shards packed, kept in {kept}; the same command resumes"
        if os.path.isdir(report.path) and not os.path.lexists(kept):
            return f"{report.path} was written"
        if not report.shards:
            return "stopped while counting the source's samples; nothing kept"
        return f"0{of} shards packed, nothing kept"
    interrupts.set_status(status)

    def progress(total: int):  # noqa: ANN202 (tqdm's update)
        bar.append(progress_bar("pack", total, "shards", args.quiet))
        return bar[0].update

    try:
        report = pack(args.dataset, args.outdir, settings, args.settings.format, args.settings.source_options(),
                      args.settings.storage, _jobs(args), progress, report)
    except KeyboardInterrupt:
        for b in bar:
            b.close()
        raise Interrupted(f"interrupted: {status()}") from None
    except PackError as exc:
        raise UsageError(f"pack stopped, {args.outdir} not written: {exc}{_resume(args.outdir)}") from None
    except OSError as exc:
        raise UsageError(_unwritten(args.outdir, exc)) from None
    finally:
        for b in bar:
            b.close()
    if args.quiet:
        return 0
    reused = f", {report.reused} of them from an earlier run" if report.reused else ""
    print(f"{report.path}: {report.shards} shards{reused}, {report.examples} examples, "
          f"strategy {report.strategy}")
    if report.fallback:
        print(f"pack: {report.fallback}")
    if report.kept:
        kinds = ", ".join(f"{n} .{ext}" for ext, n in sorted(report.kept.items()))
        print(f"--decode kept {sum(report.kept.values())} fields as bytes ({kinds}): "
              "their decoded values would not give the same bytes back")
    return 0


def _resume(outdir: str) -> str:
    """What a stopped pack kept for the next run, said after its reason (or nothing)."""
    from atlasfs.commands.pack import resumable, temporary_folder
    kept = temporary_folder(outdir)
    return (f"; the shards finished are kept in {kept}: pack again to go on from them, or delete it"
            if resumable(kept) else "")


def _unwritten(outdir: str, exc: OSError) -> str:
    """Pack's line for a write that failed: named by the OUTDIR the user gave, not by the
    hidden folder beside it that pack writes first (``.NAME.pack-partial``)."""
    from atlasfs.commands.pack import temporary_folder
    partial = temporary_folder(outdir)
    failed = os.path.abspath(exc.filename) if exc.filename else ""
    if failed != partial and not failed.startswith(partial + os.sep):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"pack stopped, {outdir} not written: {where}{exc.strerror or exc}{_resume(outdir)}"
    parent = os.path.dirname(partial)
    return (f"pack stopped, {outdir} not written: {exc.strerror or exc} (pack writes it in {parent} "
            f"first, then renames it){_resume(outdir)}")


def cmd_index(args: argparse.Namespace) -> int:
    from atlasfs.commands.indexing import IndexReport
    report = IndexReport()
    where: dict[str, object] = {}

    def status() -> str:
        if "shards" not in where:
            return "no file table stored"
        return (f"{report.stored_before + report.built} of {where['shards']} file tables stored in {where['folder']}; "
                "the same command builds the rest")
    interrupts.set_status(status)
    try:
        return _index(args, report, where)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: {status()}") from None


def _index(args: argparse.Namespace, report: object, where: dict[str, object]) -> int:
    from atlasfs.commands.indexing import index_all, make_store, store_energon_index
    with _source(args) as dataset:
        store = make_store(dataset, args.settings.index_dir)
        if args.settings.index_dir is not None or not dataset.storage.remote:  # a bucket says so at the first write
            _writable_index_dir(store.save_folder)
        where.update(shards=len(dataset.shards), folder=store.save_folder)
        report = index_all(dataset, _opener(args), args.settings.index_dir, _jobs(args), result=report,
                           quiet=args.quiet)
        shards = len(dataset.shards)
        if report.unstored:
            raise UsageError(f"{store.save_folder}: {report.unstored} of {shards} file tables "
                             "could not be stored (see above)")
        done = shards - report.failed
        before = f" ({report.stored_before} of them were already)" if report.stored_before else ""
        if not args.quiet:
            print(f"file tables of {done} of {shards} shards are up to date in {store.save_folder}{before}"
                  if report.failed else f"file tables of {done} shards are up to date in {store.save_folder}{before}")
        # energon's index.sqlite beside the tables, said only when it could not be stored (the
        # tables' line is the summary); not into a bucket: mounts build it in the user's cache
        if done and (args.settings.index_dir is not None or not dataset.storage.remote):
            problem = store_energon_index(dataset, args.settings.index_dir)
            if problem is not None:
                print(f"atlasfs: {problem}", file=sys.stderr)
    return 1 if report.failed else 0


def cmd_cache(args: argparse.Namespace) -> int:
    from atlasfs.sizes import format_size
    from atlasfs.tree.table import store
    if args.clear:
        freed = store.clear(args.dataset)
        what = f"the tables of {args.dataset}" if args.dataset else "every table"
        print(f"removed {what} from {store.cache_root()} ({format_size(freed)})")
        return 0
    tables = store.cached_tables(args.dataset)
    by_dataset: dict[str, list[store.CachedTable]] = {}
    for table in tables:
        by_dataset.setdefault(table.dataset, []).append(table)
    for dataset, found in sorted(by_dataset.items(), key=lambda item: -item[1][-1].used):
        print(f"{dataset}: {len(found)} tables, {format_size(sum(t.bytes for t in found))}")
    total = sum(t.bytes for t in tables)
    print(f"{store.cache_root()}: {format_size(total)} of {format_size(store.cache_bound())} "
          "(least recently used tables go first past that bound; ATLASFS_TABLE_CACHE_SIZE sets it)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from atlasfs.commands.demo import write_demo
    write_demo(args.path, args.count)
    print(f"wrote the demo dataset to {args.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``atlasfs``."""
    from atlasfs.commands.parsing import Parser
    from atlasfs.formats.factory import FORMATS
    from atlasfs.commands.jobs import add_executor_arguments
    from atlasfs.options import add_flags, mount_option_names
    parser = Parser(
        prog="atlasfs",
        description="Mount ML datasets read-only as WebDataset-style file trees (FUSE), and look at, check, "
                    f"export and pack them without mounting. Formats: {', '.join(FORMATS)} (found by their "
                    "layout, or named with --format); local folders or object storage (s3://...).")
    parser.add_argument("--version", action="version", version=f"atlasfs {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (debug level)")
    # -v after the command name too; SUPPRESS keeps a -v given before it from being reset
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log more (debug level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(func=func)
        parser.commands[name] = p
        return p

    def quiet(p: argparse.ArgumentParser) -> None:
        p.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar and no closing summary: only what went wrong is said")

    def source(p: argparse.ArgumentParser, command: str) -> None:
        p.add_argument("dataset", help="the dataset: an Atlas folder (meta.json), a Dolma folder (documents/), "
                                       "a folder of Lavender shardsets, a .pbin file or folder of them, a .tar file or folder of "
                                       "them, or the s3:// (or other fsspec) URL of such a folder")
        add_flags(p, command)

    p = command("info", cmd_info, "summarise a dataset: shards, examples, blocks, strategies, sizes")
    source(p, "info")
    p = command("verify", cmd_verify, "decode every block and check everything; exit 1 if anything is wrong")
    source(p, "verify")
    add_executor_arguments(p)
    quiet(p)
    p = command("show", cmd_show, "print one example readably")
    source(p, "show")
    p.add_argument("index", type=int, help="global example index (negative counts from the end)")

    p = command("mount", cmd_mount, "mount a dataset read-only as a WebDataset-style tree")
    source(p, "mount")
    p.add_argument("mountpoint", help="empty folder to mount on")
    p.add_argument("-f", "--foreground", action="store_true",
                   help="stay in the foreground until unmounted or signalled (for systemd: Type=notify)")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help=f"mount options, the flags' names with underscores ({mount_option_names()}), and libfuse "
                        "options such as default_permissions, uid=N or max_read=N; fstab-only options (nofail, "
                        "noauto, x-systemd.*...) are ignored")

    p = command("umount", cmd_umount, "unmount an atlasfs mount (other file systems are refused)")
    p.add_argument("mountpoint", help="the mount point of an atlasfs mount")
    p.add_argument("-z", "--lazy", action="store_true",
                   help="detach now even if busy or dead (the mount goes once nothing uses it)")

    p = command("export", cmd_export, "write each shard as a WebDataset tar (<shard>.tar, samples in example order) "
                                      "and a wids index (shards.json), without FUSE")
    source(p, "export")
    add_executor_arguments(p)
    p.add_argument("outdir", help="folder for the tar files (created if missing)")
    p.add_argument("--shards", nargs="+", metavar="SHARD", help="shard folder names to export (default: all)")
    quiet(p)

    p = command("pack", cmd_pack, "write any dataset atlasfs mounts as an Atlas v1 dataset (the reference "
                                  "writer's rules) whose mount shows the same files byte for byte")
    source(p, "pack")
    add_executor_arguments(p)
    p.add_argument("outdir", help="the Atlas dataset to write (must not exist; written beside it, then renamed)")
    p.add_argument("--shard-size", type=int, metavar="N",
                   help="examples per shard (default: one Atlas shard per source shard)")
    p.add_argument("--block-size", type=int, default=64, metavar="N", help="examples per block (default 64)")
    p.add_argument("--strategy", type=int, choices=range(4), default=2,
                   help="0 none, 1 zstd, 2 one dictionary trained on the first shard and shared (default), "
                        "3 one dictionary per shard; a shard of fewer than 7 blocks falls back to 1")
    p.add_argument("--level", type=int, default=3, help="zstd compression level (default 3)")
    p.add_argument("--dict-size", type=float, default=0.01, metavar="FRACTION",
                   help="dictionary size as a fraction of a shard's bytes (default 0.01)")
    p.add_argument("--decode", action="store_true",
                   help="store .cls/.txt/.json/.npy/.npz fields as their decoded values (webdataset's default "
                        "decoders) where encoding them gives the same bytes back; others stay bytes")
    quiet(p)

    p = command("index", cmd_index,
                "build the shards' file tables ahead of time, beside the dataset (DATASET/.atlasfs-tables), "
                "so that every mount of it lists without decoding")
    source(p, "index")
    add_executor_arguments(p)
    quiet(p)

    p = command("cache", cmd_cache, "show or clear the file tables mounts keep in the user's cache")
    p.add_argument("dataset", nargs="?", help="only this dataset's tables")
    p.add_argument("--clear", action="store_true", help="delete them")

    p = command("demo", cmd_demo, "write the small built-in demo dataset")
    p.add_argument("path", help="where to write it (must not exist)")
    p.add_argument("--count", type=int, default=200, help="number of examples (default 200)")
    return parser


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("atlasfs: %(message)s"))
    root = logging.getLogger("atlasfs")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def mount_helper(argv: Sequence[str] | None = None) -> int:
    """``mount.fuse.atlasfs SOURCE MOUNTPOINT [-sfnv] [-o OPTS]``: what mount(8) runs for
    ``fuse.atlasfs`` lines in /etc/fstab. Returns once the mount is live."""
    parser = argparse.ArgumentParser(prog="mount.fuse.atlasfs", description=mount_helper.__doc__)
    parser.add_argument("dataset")
    parser.add_argument("mountpoint")
    parser.add_argument("-o", dest="options", action="append", default=[])
    parser.add_argument("-t", dest="type")  # the type mount(8) was given; nothing to do with it
    parser.add_argument("-N", dest="namespace")
    for flag in ("-s", "-f", "-n", "-v"):  # sloppy, fake, no mtab, verbose: mount(8)'s own
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    if args.f:
        return 0
    return main(["mount", args.dataset, args.mountpoint, *(f"-o{o}" for o in args.options)])


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``atlasfs``; returns the exit code."""
    previous = interrupts.install()  # first: a Ctrl-C while the commands' modules load is one line too
    try:
        status = _main(argv, previous)
        sys.stdout.flush()  # here, not at exit: a reader gone (| head) is said by the except below
        return status
    except BrokenPipeError:
        return _reader_gone()
    except Interrupted as exc:
        interrupts.say(f"atlasfs: {exc.line}")
        return interrupts.STATUS
    except KeyboardInterrupt:  # before a command said what it keeps
        interrupts.say("atlasfs: interrupted before anything was written")
        return interrupts.STATUS
    finally:
        interrupts.set_status(None)
        interrupts.restore(previous)


def _reader_gone() -> int:
    """The reader of the output left (``atlasfs info DS | head -5``): end quietly, as the tools
    a shell pipes into head do (killed by SIGPIPE: status 128 + 13). The output is pointed at
    /dev/null so that the interpreter's flush at exit finds no broken pipe to complain about."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # no descriptor (a stream replaced by the caller)
            pass
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None, previous: dict[int, object]) -> int:
    from atlasfs.fuse.mount import MountError
    from atlasfs.options import OptionError, from_args
    from atlasfs.storage import set_default_options
    from atlasfs.commands.jobs import ray_address_apart
    # --ray's address is optional: a word after it that is no address is the next positional
    args = build_parser().parse_args(ray_address_apart(sys.argv[1:] if argv is None else argv))
    _setup_logging(args.verbose)
    if args.command not in INTERRUPTIBLE:
        interrupts.restore(previous)
    try:
        if hasattr(args, "dataset") and args.command != "cache":
            args.settings = from_args(args)  # every setting: -o options, then flags
            set_default_options(args.settings.storage)
        return args.func(args)
    except BrokenPipeError:  # the reader of the output left: main ends quietly
        raise
    except AtlasFormatError as exc:
        hint = _shard_folder_hint(args.dataset, args.command) if getattr(args, "dataset", None) and args.command != "cache" else ""
        print(f"atlasfs: {exc}{hint}", file=sys.stderr)
    except (MountError, OptionError, UsageError) as exc:
        print(f"atlasfs: {exc}", file=sys.stderr)
    except FileExistsError as exc:
        print(f"atlasfs: {exc}", file=sys.stderr)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"atlasfs: {where}{exc.strerror or exc}", file=sys.stderr)
    except KeyboardInterrupt:
        if args.command in INTERRUPTIBLE:
            raise
        print("atlasfs: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
