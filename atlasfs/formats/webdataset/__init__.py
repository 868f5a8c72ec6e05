"""WebDataset tar shards as a source: a folder of ``.tar`` files, each a folder of its samples' files.

Each ``.tar`` file under the dataset folder (any depth, sorted by path) is a shard, a
folder of the tree named by its path without ``.tar``. Its members are grouped into
samples by webdataset's own rule (:mod:`.samples`): a member's key is its path up to the
first ``.`` of its last component, a sample is a run of adjacent members with the same
key, in archive order. A sample is ``{"__key__": key, "<field>": the member's bytes...}``,
so the naming layer shows each member as ``<key>.<field>`` with its bytes as they are
(field lower-cased, as webdataset does), and the tar view and ``atlasfs export`` give
webdataset back the same samples.

:meth:`TarShard.prepare` is one pass over the tar's headers (:mod:`.walk`, through
:mod:`tarfile`, data skipped by seeking), whose result (every member's name, data offset
and size) is stored with the shard's file table through :mod:`atlasfs.formats.state`; a
later mount restores it and reads no header. Blocks are runs of up to
:data:`BLOCK_SAMPLES` samples and about :data:`BLOCK_BYTES`, each read in one ``pread``;
the file table is built from the members' sizes without reading any member.

Bad input is one problem line each (logged by a mount, listed by ``verify``) naming the
shard and member: a member webdataset cannot group (no ``.`` in its name), a second file
of one field in a sample (left out: webdataset refuses it), a link or special file, a bad
header part-way (the rest of the tar is left out, as tarfile and so webdataset stop
there). A member cut short by the file's end fails its sample's block alone (EIO); the
samples before it serve. Compressed shards (``.tar.gz``) are not read: their members
cannot be reached without inflating everything before them. Local files only.
"""

from __future__ import annotations

import os
from typing import Any

from atlasfs.formats.source import file_or_folder_of
from atlasfs.formats.webdataset.samples import BLOCK_BYTES, BLOCK_SAMPLES, Samples, group, key_field
from atlasfs.formats.webdataset.source import STATE_VERSION, SUFFIX, TarShard, WebDatasetSource, find_tar_files
from atlasfs.formats.webdataset.walk import Walk, WebDatasetError, walk
from atlasfs.storage import LOCAL, Storage

__all__ = ["BLOCK_BYTES", "BLOCK_SAMPLES", "STATE_VERSION", "SUFFIX", "Samples", "TarShard", "Walk",
           "WebDatasetError", "WebDatasetSource", "find_tar_files", "group", "key_field", "looks_like",
           "open_source", "walk"]


def looks_like(path: str, storage: Storage = LOCAL) -> bool:
    """A ``.tar`` file, or a folder with one directly inside (no file is opened)."""
    return file_or_folder_of(path, SUFFIX, storage)


def open_source(path: str, options: Any, storage: Storage = LOCAL) -> WebDatasetSource:
    """The tar file or folder of them at ``path``, read through ``storage`` (``options`` change
    nothing for this format)."""
    return WebDatasetSource(os.fspath(path), storage)
