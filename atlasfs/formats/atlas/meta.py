"""The JSON metadata of an Atlas v1 dataset: parsing and strict validation."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any

from atlasfs.errors import AtlasFormatError
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError, UnfitFileError

FORMAT_VERSION = 1
#: A meta.json is a few hundred bytes; refuse to read a huge one into memory.
MAX_META_BYTES = 1 << 20


class CompressionStrategy(IntEnum):
    """How the blocks of a shard are compressed (names as in the reference)."""

    NO_COMPRESSION = 0
    STANDARD_COMPRESSION = 1
    SHARED_DICTIONARY_COMPRESSION = 2
    DICTIONARY_COMPRESSION = 3


@dataclass(frozen=True)
class RootMeta:
    """The dataset's root ``meta.json``.

    ``shard_sizes`` is informational: readers take the sizes from the shard
    metas, as the reference does.
    """

    version: int
    shard_sizes: tuple[int, ...]
    compression_strategy: CompressionStrategy

    def to_json(self) -> str:
        """Serialise exactly as the reference writer does (key order, indent 4)."""
        return json.dumps(
            {"version": self.version, "shard_sizes": list(self.shard_sizes),
             "compression_strategy": int(self.compression_strategy)},
            indent=4,
        )


@dataclass(frozen=True)
class ShardMeta:
    """A shard's ``meta.json``. ``compression_level`` and ``compression_dict_size``
    are recorded for reference only; reading never uses them."""

    version: int
    block_size: int
    stored_examples: int
    compression_strategy: CompressionStrategy
    compression_level: int
    compression_dict_size: float

    @property
    def num_blocks(self) -> int:
        """Blocks in the shard: ceil(stored_examples / block_size)."""
        return -(-self.stored_examples // self.block_size)

    def to_json(self) -> str:
        """Serialise exactly as the reference writer does (key order, indent 4)."""
        data = asdict(self)
        data["compression_strategy"] = int(self.compression_strategy)
        return json.dumps(data, indent=4)


ROOT_KEYS = ("version", "shard_sizes", "compression_strategy")
SHARD_KEYS = ("version", "block_size", "stored_examples", "compression_strategy",
              "compression_level", "compression_dict_size")


def read_file(path: str, storage: Storage = LOCAL, limit: int | None = None, what: str = "",
              max_bytes: int | None = None) -> bytes:
    """The bytes of ``path`` (its first ``limit``) through ``storage``, or
    :class:`AtlasFormatError` naming it (``what``: what it is, for the message). With
    ``max_bytes``, the whole file, refused unread if it is larger (``what`` names the bound:
    ``"a zstd dictionary"``). Anything but a regular file is refused unread, never waited
    on (``X: not a regular file (a FIFO)``). A store that does not answer raises
    :class:`StorageUnavailableError` (transient, not a fault of the file)."""
    try:
        if max_bytes is not None:
            return storage.read_bounded(path, max_bytes, what or "the file")
        return storage.read(path, limit)
    except StorageUnavailableError:
        raise
    except FileNotFoundError:
        raise AtlasFormatError(f"{path}: missing") from None
    except UnfitFileError as exc:  # its message names the file and what it is
        raise AtlasFormatError(str(exc)) from None
    except OSError as exc:
        raise AtlasFormatError(f"{path}: cannot read{what and ' ' + what} ({exc.strerror})") from None


def read_json_object(path: str, storage: Storage = LOCAL) -> dict[str, Any]:
    """Read ``path`` (through ``storage``) as a JSON object, or raise :class:`AtlasFormatError`
    (:func:`read_file`)."""
    raw = read_file(path, storage, MAX_META_BYTES + 1)
    if len(raw) > MAX_META_BYTES:
        raise AtlasFormatError(f"{path}: larger than {MAX_META_BYTES} bytes, not a meta.json")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise AtlasFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AtlasFormatError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _check_keys(path: str, data: dict[str, Any], expected: tuple[str, ...]) -> None:
    missing = [k for k in expected if k not in data]
    extra = [k for k in data if k not in expected]
    if missing:
        raise AtlasFormatError(f"{path}: missing key {missing[0]!r}")
    if extra:
        raise AtlasFormatError(f"{path}: unexpected key {extra[0]!r}")


def _int(path: str, data: dict[str, Any], key: str, minimum: int | None = None) -> int:
    value = data[key]
    if type(value) is not int:  # bool and float are not accepted
        raise AtlasFormatError(f"{path}: {key!r} must be an integer, found {value!r}")
    if minimum is not None and value < minimum:
        raise AtlasFormatError(f"{path}: {key!r} must be >= {minimum}, found {value}")
    return value


def _version(path: str, data: dict[str, Any]) -> int:
    version = _int(path, data, "version")
    if version != FORMAT_VERSION:
        raise AtlasFormatError(f"{path}: unsupported format version {version} (atlasfs reads version {FORMAT_VERSION})")
    return version


def _strategy(path: str, data: dict[str, Any]) -> CompressionStrategy:
    value = _int(path, data, "compression_strategy")
    try:
        return CompressionStrategy(value)
    except ValueError:
        raise AtlasFormatError(f"{path}: unknown compression_strategy {value} (expected 0, 1, 2 or 3)") from None


def parse_root_meta(root: str, storage: Storage = LOCAL) -> RootMeta:
    """Read and validate ``<root>/meta.json``."""
    path = os.path.join(root, "meta.json")
    data = read_json_object(path, storage)
    _check_keys(path, data, ROOT_KEYS)
    sizes = data["shard_sizes"]
    if not isinstance(sizes, list) or any(type(s) is not int or s < 0 for s in sizes):
        raise AtlasFormatError(f"{path}: 'shard_sizes' must be a list of non-negative integers")
    return RootMeta(_version(path, data), tuple(sizes), _strategy(path, data))


def parse_shard_meta(shard_dir: str, storage: Storage = LOCAL) -> ShardMeta:
    """Read and validate ``<shard_dir>/meta.json``."""
    path = os.path.join(shard_dir, "meta.json")
    data = read_json_object(path, storage)
    _check_keys(path, data, SHARD_KEYS)
    dict_size = data["compression_dict_size"]
    if type(dict_size) not in (int, float):
        raise AtlasFormatError(f"{path}: 'compression_dict_size' must be a number, found {dict_size!r}")
    return ShardMeta(
        version=_version(path, data),
        block_size=_int(path, data, "block_size", minimum=1),
        stored_examples=_int(path, data, "stored_examples", minimum=0),
        compression_strategy=_strategy(path, data),
        compression_level=_int(path, data, "compression_level"),
        compression_dict_size=float(dict_size),
    )
