"""The format contract's fixtures (tests/contract/contract.py holds its checks): what a format's
subclass says about itself (its name, how to write a small dataset, what files it must show,
how to damage a shard, how to open it), the ``dataset`` fixture, and the expectation helpers
the formats' own tests share."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import pytest

from atlasfs.formats import naming
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.formats.source import Source, SourceShard


def shard_files(shard: SourceShard) -> dict[str, bytes]:
    """A shard's files as the naming layer makes them from its decoded samples: the
    expectation of a format whose writer cannot say its files' bytes by itself."""
    assigner = naming.KeyAssigner(shard.key_width)
    out: dict[str, bytes] = {}
    for block in range(shard.num_blocks):
        samples, _ = shard.decode_block(block)
        assert len(samples) == shard.block_length(block)
        for pos, sample in enumerate(samples):
            fields, note = naming.example_fields(sample, naming.MAX_NAME_BYTES - 1 - shard.key_width)
            assert note is None, note
            longest = max(len(s.encode()) for s, _ in fields)
            key, _ = assigner.assign(naming.declared_key(sample), shard.first_index + block * shard.block_size + pos,
                                     longest)
            for suffix, value in fields:
                out[f"{key}.{suffix}"] = naming.encode_as(suffix, value)
    return out


def samples_of(names: Iterable[str]) -> list[str]:
    """The samples' keys (a name up to its first dot), in the order their files first come."""
    return list(dict.fromkeys(name.split(".", 1)[0] for name in names))


class FormatFixtures:
    """What a format's contract test says about its format; subclasses set :attr:`kind` and
    write their datasets."""

    #: The format's name, as ``--format`` takes it.
    kind: ClassVar[str]
    #: Command-line options the dataset needs beyond its layout.
    options: ClassVar[tuple[str, ...]] = ()

    def write(self, root: Path) -> Path:
        """Write a small dataset of at least two shards under ``root``; return its path."""
        raise NotImplementedError

    def expected(self, dataset: Path) -> dict[str, dict[str, bytes]]:
        """Folder -> {file: bytes} in listing order. By default from the source's own samples
        named by the naming layer; formats whose writer knows its files' bytes override it."""
        with self.source(dataset) as source:
            out = {}
            for shard in source.shards:
                shard.prepare()
                out[shard.name] = shard_files(shard)
            return out

    def damage(self, dataset: Path) -> str:
        """Damage one shard so that (some of) its files cannot be read; return its folder."""
        raise NotImplementedError

    def source(self, dataset: Path) -> Source:
        """The dataset opened as this format."""
        flag = "--uid-column"
        uid = self.options[self.options.index(flag) + 1] if flag in self.options else SourceOptions.uid_column
        return open_source(str(dataset), self.kind, SourceOptions(uid_column=uid))

    @pytest.fixture
    def dataset(self, tmp_path: Path) -> Path:
        """The subclass's dataset, written afresh under tmp_path."""
        return self.write(tmp_path / "ds")
