"""The settings of every command and of a mount, in one table.

Each :class:`Option` is one setting with one name: ``-o NAME=VALUE`` for a mount (and
fstab), ``--NAME`` (dashes for underscores) on the command line of the commands that take
it, how its text is read, and its one default, the field's default in :class:`MountOptions`
or :class:`~atlasfs.storage.StorageOptions`. An option's meaning never depends on the shape
of its value: ``uid=`` is libfuse's file owner, Lavender's join column is ``uid_column=``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from atlasfs.formats.factory import FORMATS, SourceOptions
from atlasfs.sizes import format_size, parse_size
from atlasfs.storage import StorageOptions
from atlasfs.tree.blocktree import DEFAULT_CACHE_BYTES

#: The decoded cache's default bound (``--decoded-cache-size``), lowered to a quarter of the
#: folder's free space at mount when that is less.
DECODED_CACHE_BYTES = 8 << 30
#: What a mount can show: the files of every sample (``files``), each shard as one
#: tar file with a wids index (``tars``), or both side by side.
VIEWS = ("files", "tars", "both")
#: The commands that take a dataset, and so the options of how it is read.
DATASET_COMMANDS = ("info", "verify", "show", "mount", "export", "index", "pack")

#: Options mount(8) and fstab pass along that mean nothing to a FUSE daemon.
MOUNT_ONLY = frozenset({
    "defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "owner", "group",
    "ro", "sync", "async", "atime", "noatime", "relatime", "norelatime", "strictatime", "nodiratime",
    "diratime", "lazytime", "nolazytime",
})
MOUNT_ONLY_PREFIXES = ("x-", "comment=", "_")
#: libfuse options handed through (libfuse 2's names: the native engine gives libfuse's session
#: the mount's own and answers the others itself, :data:`atlasfs.fuse.engine.SESSION_OPTIONS`).
FUSE_OPTIONS = frozenset({
    "allow_root", "default_permissions", "nosuid", "suid", "nodev", "dev", "noexec", "exec",
    "max_read", "max_readahead", "uid", "gid", "umask", "attr_timeout", "entry_timeout",
    "negative_timeout", "kernel_cache", "auto_cache", "fsname", "max_background",
    "congestion_threshold", "async_read", "sync_read", "noforget", "remember", "max_idle_threads", "max_threads",
})


class OptionError(ValueError):
    """An option given wrong, for the user (one line)."""


@dataclass
class MountOptions:
    """Every setting of a command or mount (the fields the table's options set)."""

    cache_bytes: int = DEFAULT_CACHE_BYTES
    trust_pickle: bool = False
    allow_other: bool = False
    foreground: bool = False
    debug: bool = False
    threads: bool = True
    log_file: str | None = None
    index_dir: str | None = None
    view: str = "files"
    #: The tar view's energon split.yaml: a train:val:test ratio or a file (None: every tar in train).
    energon_split: str | None = None
    #: A file served as the tar view's energon dataset.yaml (None: CrudeWebdataset).
    energon_dataset: str | None = None
    #: The dataset's format (None: found from its layout).
    format: str | None = None
    #: Lavender: the column joining a shard's shardsets (None: found from the data).
    uid_column: str | None = SourceOptions.uid_column
    #: Lavender: how the other shardsets join onto the main one (``inner`` or ``left``).
    join: str = SourceOptions.join
    #: Lavender: the shardset the others join onto (None: found from the data).
    main_shardset: str | None = SourceOptions.main_shardset
    fuse_options: dict[str, str | bool] = field(default_factory=dict)
    #: How a dataset in object storage is read (docs/storage.md); unused for local folders.
    storage: StorageOptions = field(default_factory=StorageOptions)
    #: Open damaged shards as far as their files go (``show``; :class:`SourceOptions`).
    lenient: bool = False
    #: Processes working on shards at once (``index``, ``export``; None: one per core).
    jobs: int | None = None
    #: A folder to keep blocks decompressed whole in, as files (None: off; docs/native.md).
    decoded_cache: str | None = None
    #: The bound of ``decoded_cache`` (None: :data:`DECODED_CACHE_BYTES`, or a quarter of the
    #: folder's free space when that is less).
    decoded_cache_bytes: int | None = None

    def describe(self) -> str:
        """The settings that matter, for the log."""
        flags = [f"cache {format_size(self.cache_bytes)}", "threads" if self.threads else "single thread"]
        flags += [name for name in ("allow_other", "trust_pickle") if getattr(self, name)]
        if self.decoded_cache is not None:
            bound = "" if self.decoded_cache_bytes is None else f" ({format_size(self.decoded_cache_bytes)})"
            flags.append(f"decoded cache {self.decoded_cache}{bound}")
        flags += [k if v is True else f"{k}={v}" for k, v in self.fuse_options.items()]
        return ", ".join(flags)

    def source_options(self) -> SourceOptions:
        """What the source is told about how to read the dataset."""
        return SourceOptions(trust_pickle=self.trust_pickle, uid_column=self.uid_column, join=self.join,
                             main_shardset=self.main_shardset, lenient=self.lenient)

    def apply(self, option_text: str) -> None:
        """Apply a ``-o`` argument (comma-separated, as FUSE tools take them)."""
        for item in filter(None, (part.strip() for part in option_text.split(","))):
            name, has_value, value = item.partition("=")
            if name in MOUNT_ONLY or item.startswith(MOUNT_ONLY_PREFIXES):
                continue
            if name == "rw":
                raise OptionError("atlasfs mounts are read-only: drop the 'rw' option")
            option = BY_NAME.get(name)
            if option is not None:
                if bool(has_value) == (option.read is None):
                    raise OptionError(f"-o {name}: " + ("takes no value" if option.read is None else
                                                        f"takes a value: {name}={option.metavar or 'VALUE'}"))
                try:
                    read = option.read(value) if option.read is not None else option.switch
                except ValueError as exc:
                    raise OptionError(f"-o {name}: {exc}") from None
                option.set(self, read, f"-o {name}")
            elif name == "uid" and not value.isdigit():
                raise OptionError(f"-o {item}: uid= is libfuse's file owner, a number "
                                  "(Lavender's join column is uid_column=COLUMN)")
            elif name in FUSE_OPTIONS:
                self.fuse_options[name] = value if has_value else True
            else:
                raise OptionError(f"unknown mount option {item!r}")


def _choice(choices: Sequence[str], what: str) -> Callable[[str], str]:
    def read(text: str) -> str:
        if text not in choices:
            raise ValueError(f"unknown {what} {text!r} (choose one of: {', '.join(choices)})")
        return text
    return read


@dataclass(frozen=True)
class Option:
    """One setting: ``-o NAME``, ``--NAME`` for ``commands``, read by ``read`` (None: a
    switch, which sets ``switch``), stored in ``field`` of :class:`MountOptions`
    (``storage.FIELD``: of its :class:`~atlasfs.storage.StorageOptions`)."""

    name: str
    field: str
    read: Callable[[str], Any] | None
    help: str
    commands: tuple[str, ...] = ()
    metavar: str | None = None
    switch: Any = True
    #: A one-letter flag too (``-j``), besides :attr:`flag`.
    short: str | None = None

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return "--" + self.name.replace("_", "-")

    def _owner(self, options: MountOptions) -> tuple[Any, str]:
        owner, _, name = self.field.rpartition(".")
        return (options.storage if owner else options), name

    def default(self) -> Any:
        """The one default (the field's in a fresh :class:`MountOptions`)."""
        owner, name = self._owner(MountOptions())
        return getattr(owner, name)

    def set(self, options: MountOptions, value: Any, said: str) -> None:
        """Set ``value`` in ``options``, checked; :class:`OptionError` names ``said`` if wrong."""
        owner, name = self._owner(options)
        old = getattr(owner, name)
        setattr(owner, name, value)
        if owner is options.storage:
            try:
                owner.__post_init__()  # checks, and widens the buffer to the window
            except ValueError as exc:
                setattr(owner, name, old)
                raise OptionError(f"{said}: {exc}") from None

    def described(self) -> str:
        """The help text, with the default."""
        default = self.default()
        if default is None or self.read is None:
            return self.help
        shown = format_size(default) if self.read is parse_size else default
        return f"{self.help} (default {shown})"


def _text(text: str) -> str:
    return text


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if count < 1:
        raise ValueError(f"must be at least 1, not {count}")
    return count


#: Every option, in the order ``--help`` lists them.
OPTIONS: tuple[Option, ...] = (
    Option("format", "format", _choice(tuple(FORMATS), "format"),
           "read the dataset as this format (default: found from its layout)", DATASET_COMMANDS, "KIND"),
    Option("uid_column", "uid_column", _text, "Lavender: the column joining the shardsets (default: the one "
           "column every shardset has; uid, id, then __key__ if they share more)", DATASET_COMMANDS, "COLUMN"),
    Option("join", "join", _choice(("inner", "left"), "join"), "Lavender: inner leaves out a sample some "
           "shardset lacks (lavender-data's default); left shows it without that shardset's files",
           DATASET_COMMANDS, "inner|left"),
    Option("main_shardset", "main_shardset", _text, "Lavender: the shardset whose rows are the samples, the "
           "others joined onto them (default: the one with the most shards, then the most columns)",
           DATASET_COMMANDS, "SHARDSET"),
    Option("trust_pickle", "trust_pickle", None, "unpickle Atlas blocks and .pbin indexes without the allow-list: "
           "runs code from the dataset; only for datasets you trust", DATASET_COMMANDS),
    Option("cache_size", "cache_bytes", parse_size, "bound of the block cache (decoded blocks and their files), "
           "e.g. 512M or 2G", ("mount", "export"), "SIZE"),
    Option("decoded_cache", "decoded_cache", _text, "keep blocks decompressed whole in files in DIR (yours, "
           "writable by no one else; made 0700 if missing), so that later reads and mounts read them from the page "
           "cache instead of decompressing again (default: off)", ("mount",), "DIR"),
    Option("decoded_cache_size", "decoded_cache_bytes", parse_size, "bound of --decoded-cache, the files already in "
           "DIR included, least recently used first to go (default 8G, or a quarter of DIR's free space when "
           "less)", ("mount",), "SIZE"),
    Option("view", "view", _choice(VIEWS, "view"), "what to show: the files of every sample, one folder per shard "
           "(files); each shard as one seekable <shard>.tar with a wids index shards.json (tars); or both",
           ("mount",), "VIEW"),
    Option("energon_split", "energon_split", _text, "the tar view's .nv-meta/split.yaml for Megatron-Energon: "
           "TRAIN:VAL:TEST weights cutting the tars in energon's order (energon prepare --split-ratio), or a "
           "split.yaml of yours, served as it is (default: every tar in train)", ("mount",), "RATIO|FILE"),
    Option("energon_dataset", "energon_dataset", _text, "a dataset.yaml of yours (sample type and field map), "
           "served as the tar view's .nv-meta/dataset.yaml (default: CrudeWebdataset)", ("mount",), "FILE"),
    Option("index_dir", "index_dir", _text, "the folder of file tables: a mount reads them there first and stores "
           "new ones there (else in the user's cache, ~/.cache/atlasfs; tables 'atlasfs index' wrote beside the "
           "dataset are read too); index stores them there instead of beside the dataset", ("mount", "index"),
           "DIR"),
    Option("jobs", "jobs", _count, "shards worked on at once, each in a process of its own (default: one per "
           "core)", ("export", "index", "pack"), "N", short="-j"),
    Option("log_file", "log_file", _text, "append the daemon's log here (else stderr with -f, syslog, or with no "
           "/dev/log $XDG_STATE_HOME/atlasfs/<mount point>.log, rotated at 1 MiB x 3)", ("mount",), "PATH"),
    Option("allow_other", "allow_other", None, "let other users read the mount", ("mount",)),
    Option("debug", "debug", None, "libfuse's debug output"),
    Option("nothreads", "threads", None, "serve one request at a time", switch=False),
    # A dataset in object storage (s3://bucket/prefix, gs://..., https://...): docs/storage.md.
    # Credentials come from the environment and the AWS config files, never from here.
    Option("endpoint_url", "storage.endpoint_url", _text,
           "the S3 API's address for s3:// datasets (default: $AWS_ENDPOINT_URL, else AWS)", DATASET_COMMANDS, "URL"),
    Option("disk_cache", "storage.disk_cache", _text,
           "keep the raw ranges read from a bucket in DIR, for later reads and mounts", DATASET_COMMANDS, "DIR"),
    Option("disk_cache_size", "storage.disk_cache_bytes", parse_size,
           "bound of --disk-cache (least recently used go first)", DATASET_COMMANDS, "SIZE"),
    Option("coalesce", "storage.coalesce_bytes", parse_size, "a sequential reader's GETs from a bucket cover this much", metavar="SIZE"),
    Option("prefetch", "storage.prefetch", int, "ranges a sequential reader has in flight ahead of it", metavar="N"),
    Option("buffer_size", "storage.buffer_bytes", parse_size, "bound of the buffer of ranges fetched ahead", metavar="SIZE"),
    Option("deadline", "storage.deadline", float, "seconds a read from a bucket may wait for the store, retries "
           "included (then EIO, or for a command one line)", DATASET_COMMANDS, metavar="SECONDS"),
    Option("attempt_timeout", "storage.attempt_timeout", float, "seconds one request to the store may take", metavar="SECONDS"),
)
BY_NAME = {option.name: option for option in OPTIONS}


def mount_option_names() -> str:
    """The ``-o`` names, for ``--help``."""
    return ", ".join(option.name if option.read is None else f"{option.name}=" + (option.metavar or "VALUE")
                     for option in OPTIONS)


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags of ``command``'s options to its parser."""
    for option in OPTIONS:
        if command not in option.commands:
            continue
        flags = [option.short, option.flag] if option.short else [option.flag]
        if option.read is None:
            parser.add_argument(*flags, dest=option.name, action="store_const", const=option.switch,
                                default=None, help=option.described())
            continue

        def read(text: str, option: Option = option) -> Any:
            try:
                return option.read(text)  # type: ignore[misc]
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        parser.add_argument(*flags, dest=option.name, type=read, metavar=option.metavar,
                            default=None, help=option.described())


def from_args(args: argparse.Namespace) -> MountOptions:
    """The settings of a parsed command line: its ``-o`` options, then its flags."""
    options = MountOptions()
    for text in getattr(args, "options", None) or ():
        options.apply(text)
    for option in OPTIONS:
        value = getattr(args, option.name, None)
        if value is not None:
            option.set(options, value, option.flag)
    return options
