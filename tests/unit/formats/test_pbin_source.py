"""Modalities .pbin files as a mountable source: folders, document files, sizes from the index."""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest

from atlasfs.formats import factory
from atlasfs.formats import naming
from atlasfs.formats import state as saved
from atlasfs.formats.pbin import (
    DOCUMENTS_PER_BLOCK,
    STATE_VERSION,
    PbinError,
    PbinShard,
    PbinSource,
    looks_like,
    npy_size,
    write_pbin,
)
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore


def _named(shard: PbinShard, block: int) -> list[tuple[object, list[tuple[str, int]]]]:
    """What the tree learns of a block by decoding it and naming its samples."""
    samples, _ = shard.decode_block(block)
    named = []
    for sample in samples:
        fields, note = naming.example_fields(sample, 200)
        assert note is None
        named.append((naming.declared_key(sample), [(s, len(naming.encode_as(s, v))) for s, v in fields]))
    return named


@pytest.mark.parametrize("width", [1, 2, 4])
def test_npy_size_equals_the_encoding_over_many_lengths(width: int) -> None:
    dtype = np.dtype(f"<u{width}")
    lengths = sorted({0, 1, 2, 7, 9, 10, 11, 99, 100, 101, 255, 999, 1000, 4095, 9999, 10000, 65537, 99999, 100000}
                     | {10 ** k - 1 for k in range(1, 7)} | {10 ** k for k in range(1, 7)})
    for n in lengths:
        array = np.frombuffer(np.arange(n, dtype=np.uint32).astype(dtype).tobytes(), dtype=dtype)
        assert npy_size(dtype, n) == len(naming.encode_as("npy", array)), (width, n)


@pytest.mark.parametrize("width, header", [(1, 12), (2, 12), (4, 12), (4, 8)])
def test_documents_are_npy_files_whose_sizes_come_from_the_index(tmp_path: Path, width: int, header: int) -> None:
    rng = np.random.default_rng(width)
    docs = [rng.integers(0, 1 << (8 * width), size=int(n), dtype=np.uint64).tolist()
            for n in rng.integers(0, 40, size=2 * DOCUMENTS_PER_BLOCK + 3)]
    docs[5] = []
    write_pbin(str(tmp_path / "part.pbin"), docs, token_width=width, header=header)
    assert looks_like(str(tmp_path)) and looks_like(str(tmp_path / "part.pbin"))
    for root in (tmp_path, tmp_path / "part.pbin"):  # a folder of files, or one file: one folder "part"
        with factory.open_source(str(root), "pbin") as source:
            [shard] = source.shards
            assert shard.name == "part" and shard.first_index == 0
            shard.restore(shard.prepare())
            assert (shard.num_blocks, shard.block_size, shard.key_width) == (3, DOCUMENTS_PER_BLOCK, 6)
            assert shard.problems() == []
            tokens = []
            for block in range(shard.num_blocks):
                assert shard.describe_block(block) == _named(shard, block)
                samples, _ = shard.decode_block(block)
                for sample in samples:
                    assert list(sample) == ["npy"] and sample["npy"].dtype == np.dtype(f"<u{width}")
                    tokens.append(sample["npy"].tolist())
            assert tokens == docs


def test_a_folder_has_a_folder_per_file_numbered_from_zero(tmp_path: Path) -> None:
    write_pbin(str(tmp_path / "b.pbin"), [[1]] * 12, token_width=1)
    write_pbin(str(tmp_path / "a.pbin"), [[2, 3]], token_width=4, header=8)
    (tmp_path / "notes.txt").write_text("not a pbin")
    source = factory.open_source(str(tmp_path), "pbin")
    assert isinstance(source, PbinSource)
    assert [s.name for s in source.shards] == ["a", "b"]
    assert all(s.first_index == 0 for s in source.shards)
    for shard in source.shards:
        shard.prepare()
    assert [s.num_documents for s in source.shards] == [1, 12]


def test_a_stored_state_restores_without_the_index_and_odd_states_are_refused(tmp_path: Path) -> None:
    write_pbin(str(tmp_path / "d.pbin"), [[1, 2], [3]], token_width=2)
    shard = PbinSource(str(tmp_path)).shards[0]
    state = shard.prepare()
    fresh = PbinSource(str(tmp_path)).shards[0]
    fresh.restore(state)
    assert [a["npy"].tolist() for a in fresh.decode_block(0)[0]] == [[1, 2], [3]]
    fields = {"header": 12, "width": 2, "data_bytes": 6, "starts": np.array([0, 4]), "lengths": np.array([4, 2]),
              "bad": np.zeros(0, dtype="<i8"), "problems": [], "merge": []}
    assert saved.encode("pbin", STATE_VERSION, fields) == state
    forged = [{"starts": np.array([0, 6])}, {"lengths": np.array([4, -2])}, {"starts": np.array([0, 3])},
              {"data_bytes": 1 << 40}, {"width": 3}, {"bad": np.array([5])}, {"bad": np.array([1]), "problems": []},
              {"lengths": np.array([4])}, {"starts": np.array([0.0, 4.0])}, {"merge": ["a", "b"]},
              {"merge": ["two\nlines"]}]
    for bad in [b"", b"\x05\x00\x00\x00{}", state[:-3], saved.encode("pbin", STATE_VERSION + 1, fields),
                saved.encode("dolma", STATE_VERSION, fields), *(saved.encode("pbin", STATE_VERSION, {**fields, **f})
                                                                for f in forged)]:
        with pytest.raises(ValueError):
            PbinSource(str(tmp_path)).shards[0].restore(bad)
    assert "trust_pickle" in shard.table_key() and "d.pbin" in shard.table_key()["files"]


def test_a_stored_table_with_a_forged_state_is_refused_in_one_line_and_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_pbin(str(data / "d.pbin"), [[1, 2], [3]], token_width=2)
    store = TableStore(str(data), index_dir=str(tmp_path / "tables"))
    tree = BlockTree(PbinSource(str(data)), store=store)
    assert [n for n, _, _ in tree.names("/d")] == ["000000.npy", "000001.npy"]
    [stored] = (tmp_path / "tables").iterdir()
    table = tree.table(0)
    state = PbinSource(str(data)).shards[0].prepare()
    assert table.state == state
    fields = saved.decode(state, "pbin", STATE_VERSION).values()
    # well formed, its checksums right: only the source's checks of its state refuse it
    table.state = saved.encode("pbin", STATE_VERSION, {**fields, "starts": np.array([0, 1 << 40])})
    table.save(str(stored), tree.tables.table_key(0))
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        again = BlockTree(PbinSource(str(data)), store=store)
        entry = again.lookup("/d/000001.npy")
        assert np.load(io.BytesIO(again.read(entry, 0, entry.size))).tolist() == [3]
    refused = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(refused) == 1 and "outside its data segment" in refused[0], refused


def test_bad_documents_fail_alone_naming_file_and_document(tmp_path: Path) -> None:
    data = bytes(range(20))
    path = tmp_path / "bad.pbin"
    index = [(0, 4), (2, 4), (4, 3), (10, 20), (16, 4)]
    path.write_bytes(len(data).to_bytes(8, "little") + (2).to_bytes(4, "little") + data + pickle.dumps(index))
    shard = PbinSource(str(path)).shards[0]
    shard.prepare()
    assert shard.block_size == 1 and shard.num_blocks == 5
    problems = shard.problems()
    assert len(problems) == 3 and all(str(path) in p and "\n" not in p for p in problems)
    assert [p.split(": ")[0] for p in problems] == [f"{path} document {n}" for n in (1, 2, 3)]
    assert shard.decode_block(0)[0][0]["npy"].tolist() == [0x0100, 0x0302]
    assert shard.decode_block(4)[0][0]["npy"].tolist() == [0x1110, 0x1312]
    for block in (1, 2, 3):
        assert shard.describe_block(block) is None  # the tree decodes it, which fails
        with pytest.raises(PbinError, match=f"{path} document {block}: "):
            shard.decode_block(block)
    assert shard.describe_block(4) == _named(shard, 4)


def test_a_file_that_is_not_pbin_fails_its_shard_only_in_one_line(tmp_path: Path) -> None:
    write_pbin(str(tmp_path / "good.pbin"), [[1]], token_width=2)
    (tmp_path / "junk.pbin").write_bytes(b"\x10" + bytes(30))
    source = PbinSource(str(tmp_path))
    good, junk = sorted(source.shards, key=lambda s: s.name)
    good.prepare()
    with pytest.raises(PbinError) as info:
        junk.prepare()
    assert str(tmp_path / "junk.pbin") in str(info.value) and "\n" not in str(info.value)


def test_an_unsafe_index_is_refused_unless_trusted(tmp_path: Path) -> None:
    class Tuple(tuple):  # a class the safe unpickler does not know
        pass
    import sys
    sys.modules[__name__].Tuple = Tuple  # type: ignore[attr-defined]
    Tuple.__module__, Tuple.__qualname__ = __name__, "Tuple"
    data = (7).to_bytes(2, "little")
    path = tmp_path / "t.pbin"
    path.write_bytes(len(data).to_bytes(8, "little") + (2).to_bytes(4, "little") + data
                     + pickle.dumps([Tuple((0, 2))]))
    with pytest.raises(PbinError, match="t.pbin"):
        PbinSource(str(path)).shards[0].prepare()
    trusted = factory.open_source(str(path), "pbin", factory.SourceOptions(trust_pickle=True)).shards[0]
    trusted.prepare()
    assert trusted.decode_block(0)[0][0]["npy"].tolist() == [7]


def test_not_pbin(tmp_path: Path) -> None:
    assert not looks_like(str(tmp_path)) and not looks_like(str(tmp_path / "missing"))
    with pytest.raises(PbinError, match="no .pbin file"):
        PbinSource(str(tmp_path))
