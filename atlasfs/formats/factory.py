"""Open a dataset as a :class:`~atlasfs.formats.source.Source`: by its layout, or the format asked for.

Each format module offers ``looks_like(path, storage) -> bool`` (a cheap look at the
layout, no parsing) and ``open_source(path, options, storage) -> Source``. Adding a
format is one line in :data:`FORMATS`. A URL (``s3://bucket/prefix``) is opened as a
:class:`~atlasfs.storage.Storage` first, and every format looks at and reads its files
through it (docs/storage.md), so each is detected from the bucket's layout as on disk.
"""

from __future__ import annotations

import importlib
import os
import stat
from dataclasses import dataclass

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.source import Source, refused_in_one_line
from atlasfs.storage import LOCAL, Storage, UnfitFileError, is_url, open_folder, open_regular, open_storage
from atlasfs.storage.links import approved

#: Format name -> (module, what its layout looks like, for the error when nothing matches).
#: Detection tries them in this order.
FORMATS: dict[str, tuple[str, str]] = {
    "atlas": ("atlasfs.formats.atlas", "a meta.json (Atlas)"),
    "dolma": ("atlasfs.formats.dolma", "a documents/ folder of *.json[l][.gz|.zst] (Dolma)"),
    "lavender": ("atlasfs.formats.lavender", "folders of shard.NNNNN.csv|parquet (Lavender shardsets)"),
    "pbin": ("atlasfs.formats.pbin", "a .pbin file or a folder of them (Modalities)"),
    "webdataset": ("atlasfs.formats.webdataset", "a .tar file or a folder of them (WebDataset shards)"),
}


@dataclass
class SourceOptions:
    """What the user may choose about how a dataset is read (``atlasfs mount -o``)."""

    #: Unpickle without the allow-list (Atlas blocks, .pbin indexes): runs code from the data.
    trust_pickle: bool = False
    #: Lavender: the column that joins the rows of a shard's shardsets (None: found from the data).
    uid_column: str | None = None
    #: Lavender: ``inner`` (lavender-data's default: a sample some shardset lacks is left out)
    #: or ``left`` (it is shown without that shardset's columns).
    join: str = "inner"
    #: Lavender: the shardset the others join onto (None: the one with the most shards, then columns).
    main_shardset: str | None = None
    #: Open shards as far as their files go (``show``: the blocks of a truncated Atlas
    #: ``data.bin`` before the cut), where a mount fails a damaged shard whole.
    lenient: bool = False


def detect(path: str, storage: Storage = LOCAL) -> str:
    """The format of the dataset at ``path`` (read through ``storage``); :class:`AtlasFormatError`
    (one line) if none fits."""
    if storage.remote:
        if not storage.isdir(path):
            raise AtlasFormatError(f"{storage.describe(path)}: no such dataset folder")
    else:
        _check_readable(path)
    for kind, (module, _) in FORMATS.items():
        if importlib.import_module(module).looks_like(path, storage):
            return kind
    looked_for = "; ".join(what for _, what in FORMATS.values())
    raise AtlasFormatError(f"{storage.describe(path)}: not a dataset atlasfs knows (looked for {looked_for}); "
                           "name one with --format")


def _check_readable(path: str) -> None:
    """:class:`AtlasFormatError` if ``path`` is missing, reached through a link this process
    may not follow (:mod:`atlasfs.storage.links`), neither a folder nor a regular file, or
    not readable by this user: each format's look at the layout sees an unreadable folder as
    empty, which would say "not a dataset" instead of the real cause. Nothing is opened
    before it is looked at (a device is never opened: opening some acts, a tape rewinds), and
    then only as the rule's :func:`~atlasfs.storage.open_regular` and
    :func:`~atlasfs.storage.open_folder` open it."""
    try:
        is_folder = stat.S_ISDIR(approved(path).st_mode)
    except UnfitFileError as exc:
        raise AtlasFormatError(str(exc)) from None
    except (FileNotFoundError, NotADirectoryError):
        raise AtlasFormatError(f"{path}: no such dataset (file or folder)") from None
    except PermissionError:
        raise AtlasFormatError(f"{path}: permission denied (cannot reach it: a folder above it may not be "
                               "entered; check their permissions)") from None
    except OSError as exc:
        raise AtlasFormatError(f"{path}: {exc.strerror}") from None
    try:
        if is_folder:
            fd = open_folder(path)  # opened to read: it may be listed
            try:
                if not os.access(".", os.X_OK, dir_fd=fd):  # listed, but its files cannot be opened
                    raise PermissionError
            finally:
                os.close(fd)
        else:
            os.close(open_regular(path)[0])  # a FIFO, socket or device: refused unopened
    except UnfitFileError as exc:
        raise AtlasFormatError(str(exc)) from None
    except PermissionError:
        what = "folder" if is_folder else "file"
        raise AtlasFormatError(f"{path}: permission denied (cannot read the {what}; check its permissions)") from None
    except OSError:
        pass  # anything else: the format's own checks say what is wrong


def open_source(path: str, kind: str | None = None, options: SourceOptions | None = None) -> Source:
    """Open the dataset at ``path`` (a folder, a file or a URL) as ``kind`` (None: detected
    from its layout)."""
    path = os.fspath(path)
    storage, root = open_storage(path) if is_url(path) else (LOCAL, path)
    with refused_in_one_line(root, storage):
        if kind is None:
            kind = detect(root, storage)
        if kind not in FORMATS:
            raise AtlasFormatError(f"unknown format {kind!r} (formats: {', '.join(FORMATS)})")
        module = importlib.import_module(FORMATS[kind][0])
        return module.open_source(root, options or SourceOptions(), storage)
