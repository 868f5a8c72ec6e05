"""Small Atlas datasets for the file table tests, and the user's table cache they store into."""

from __future__ import annotations

from pathlib import Path

import pytest

from atlasfs import AtlasWriter


def shards_dataset(path: Path, shards: int = 3) -> Path:
    """An Atlas dataset at path of `shards` shards of 20 examples (s000...), blocks of 4."""
    with AtlasWriter(path, shard_size=20, block_size=4, compression_strategy=1) as w:
        w.add_examples({"__key__": f"s{i:03d}", "txt": f"t{i}", "cls": i} for i in range(20 * shards))
    return path


def keyed_dataset(path: Path) -> Path:
    """An Atlas dataset at path of 3 shards of 20 examples keyed k/000..., blocks of 4."""
    with AtlasWriter(path, shard_size=20, block_size=4, compression_strategy=1) as w:
        w.add_examples({"__key__": f"k/{i:03d}", "txt": f"t{i}", "cls": i} for i in range(60))
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's table cache, under tmp_path (XDG_CACHE_HOME set there)."""
    folder = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    return folder / "atlasfs" / "tables"
