"""Dolma as a source: the shard interface, its prepared state (untrusted on restore), names,
descriptions that agree with the naming layer, damaged files, and reads from many threads."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import zstandard

from atlasfs.formats import dolma
from atlasfs.formats import state as saved
from atlasfs.formats.dolma import LINES_PER_BLOCK, DolmaError, DolmaSource, looks_like, open_source
from atlasfs.formats.factory import SourceOptions, detect
from atlasfs.formats.naming import NO_KEY, declared_key, encode_as, example_fields, index_key_width
from atlasfs.formats.source import Source, SourceShard
from dolmadata import docs, make_dataset, write_jsonl
from helpers import in_threads


def samples_of(shard: SourceShard) -> list[dict[str, object]]:
    return [s for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]


def test_looks_like_and_factory_open_it(tmp_path: Path) -> None:
    assert not looks_like(str(tmp_path))
    make_dataset(tmp_path, 5)
    assert looks_like(str(tmp_path)) and detect(str(tmp_path)) == "dolma"
    source = open_source(str(tmp_path), SourceOptions())
    assert isinstance(source, Source) and source.kind == "dolma"
    assert [s.name for s in source.shards] == ["cc/2019/a", "cc/b", "wiki"]
    assert all(isinstance(s, SourceShard) and s.first_index == 0 for s in source.shards)
    assert source.shards[0].table_files() == [str(tmp_path / "documents/cc/2019/a.jsonl.gz"),
                                              str(tmp_path / "attributes/bad/cc/2019/a.jsonl.gz"),
                                              str(tmp_path / "attributes/tox/cc/2019/a.jsonl.gz")]
    assert "attribute sets: bad, tox" in "\n".join(source.info())


def test_shards_decode_describe_and_name_like_the_naming_layer(tmp_path: Path) -> None:
    made = make_dataset(tmp_path)
    source = DolmaSource(str(tmp_path))
    for shard in source.shards:
        rows = made[shard.relative]
        state = shard.prepare()
        assert isinstance(state, bytes)
        assert shard.key_width == index_key_width(len(rows)) and shard.block_size == LINES_PER_BLOCK
        assert shard.num_blocks == 3 and [shard.block_length(b) for b in range(3)] == [512, 512, 7]
        assert shard.stored_block_size(0) > 0
        why = shard.scan_result.left_out["bad"]
        # the file, the line and both ids
        assert shard.attributes["bad"] in why and "line 601" in why and f"'{rows[601]['id']}'" in why \
            and f"'{rows[600]['id']}'" in why
        assert any("attribute set 'bad' left out" in p for p in shard.problems())
        described = [shard.describe_block(b) for b in range(shard.num_blocks)]
        samples = samples_of(shard)
        assert [json.loads(s["json"]) for s in samples] == rows
        assert [s["text"] for s in samples] == [r["text"] for r in rows]
        assert json.loads(samples[9]["tox.json"]) == {"id": rows[9]["id"], "attributes": {"tox": 9 / 7}}
        assert "bad.json" not in samples[0]
        # what describe_block told without decoding is what the naming layer makes of the samples
        named = [(declared_key(s), [(suffix, len(encode_as(suffix, value)))
                                    for suffix, value in example_fields(s, 254 - shard.key_width)[0]])
                 for s in samples]
        assert [d for block in described for d in block] == named
        assert named[0][1][0][0] == "json" and [f for f, _ in named[0][1]] == ["json", "text", "tox.json"]
        assert shard.describe_block(0) is None  # once only: the tree decodes if it asks again
        # random access, any order
        assert shard.decode_block(1)[0] == samples[LINES_PER_BLOCK:2 * LINES_PER_BLOCK]
        assert shard.decode_block(0)[0][:3] == samples[:3]


def test_restore_takes_the_state_back_without_reading_the_files(tmp_path: Path) -> None:
    made = make_dataset(tmp_path)
    states = {s.name: s.prepare() for s in DolmaSource(str(tmp_path)).shards}
    again = DolmaSource(str(tmp_path))
    for shard in again.shards:
        calls = []
        original = dolma.TextPass.chunks
        dolma.TextPass.chunks = lambda self: calls.append(self.path) or original(self)  # type: ignore[method-assign]
        try:
            shard.restore(states[shard.name])
        finally:
            dolma.TextPass.chunks = original  # type: ignore[method-assign]
        assert calls == []
        assert shard.num_blocks == 3 and shard.key_width == 6
        assert [json.loads(s["json"]) for s in samples_of(shard)] == made[shard.relative]
        assert list(shard.scan_result.left_out) == ["bad"]
        assert shard.decode_block(2)[0][-1]["tox.json"]


def _fields(state: bytes) -> dict:
    return saved.decode(state, "dolma", dolma.STATE_VERSION).values()


@pytest.mark.parametrize("relative", ["cc/2019/a.jsonl.gz", "cc/b.jsonl.zst", "wiki.jsonl"])
def test_restore_refuses_anything_malformed_or_inconsistent(tmp_path: Path, relative: str) -> None:
    make_dataset(tmp_path)
    [shard] = [s for s in DolmaSource(str(tmp_path)).shards if s.relative == relative]
    state = shard.prepare()
    fields = _fields(state)
    assert saved.encode("dolma", dolma.STATE_VERSION, fields) == state
    bad: list[bytes] = [b"", b"junk", state[:len(state) // 2], state[:40], saved.MAGIC + b"\xff\xff\xff\xff",
                        b"x" + state[1:], saved.encode("dolma", dolma.STATE_VERSION + 1, fields),
                        saved.encode("lavender", dolma.STATE_VERSION, fields)]
    sets = {n: v for n, v in fields.items() if n.startswith(("starts:", "left_out:"))}
    blocks = fields["blocks"]
    for changed in [{"lines": 10 ** 9}, {"lines": -1}, {"lines": "many"}, {"lines_per_block": 99},
                    {"problems": np.array([1])}, {"problems": ["two\nlines"]}, {"starts:tox": "left out too"},
                    {"left_out:tox": "and its starts"}, {"blocks": np.array([0, 10 ** 9], "<u8")},
                    {"blocks": blocks[:-1]}, {"blocks": blocks.astype("<i8")}, {"text_bytes": 3}, {"damage": 5},
                    {"seek:nope": b"\0" * 16}, {"extra": 1},
                    {"blocks": np.array([blocks[0], 10 ** 12, *blocks[2:]], "<u8")}]:  # out of order
        bad.append(saved.encode("dolma", dolma.STATE_VERSION, {**fields, **changed}))
    bad.append(saved.encode("dolma", dolma.STATE_VERSION, {n: v for n, v in fields.items() if n not in sets}))
    # every single byte of the body flipped in turn must never crash (ValueError or a fit)
    for raw in bad:
        with pytest.raises(ValueError):
            shard.restore(raw)
    rng = random.Random(1)
    for _ in range(200):
        mangled = bytearray(state)
        mangled[rng.randrange(len(mangled))] ^= 1 << rng.randrange(8)
        try:
            shard.restore(bytes(mangled))
        except ValueError:
            pass
    shard.restore(state)  # and the real one still fits
    assert len(samples_of(shard)) == 2 * LINES_PER_BLOCK + 7


def test_restore_refuses_a_state_of_another_file_or_other_sets(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    shards = DolmaSource(str(tmp_path)).shards
    gz_state = shards[0].prepare()
    with pytest.raises(ValueError):
        shards[2].restore(gz_state)  # a plain file's shard, another size
    with pytest.raises(ValueError):
        shards[1].restore(gz_state)
    (tmp_path / "attributes" / "tox" / "cc/2019/a.jsonl.gz").unlink()
    with pytest.raises(ValueError, match="attribute sets"):
        DolmaSource(str(tmp_path)).shards[0].restore(gz_state)
    # a gzip index made for another file (same size) is refused before zran sees it
    index = bytearray(zstandard.ZstdDecompressor().decompress(_fields(gz_state)["seek:documents"]))
    index[7:15] = (len(index) + 12345).to_bytes(8, "little")
    with pytest.raises(ValueError):
        dolma.check_gzip_index(bytes(index), os.path.getsize(shards[0].path), 10)


def test_bad_lines_become_index_keyed_json_and_are_logged_on_restore(tmp_path: Path, caplog) -> None:
    rows: list[object] = [*docs("d", 3), b"{not json\n", {"text": "no id"}, b"[1, 2]\n", {"id": 7, "text": "x"}]
    write_jsonl(tmp_path / "documents" / "a.jsonl.gz", rows, "gz")
    [shard] = DolmaSource(str(tmp_path)).shards
    state = shard.prepare()
    assert [p.split(":")[1].split(";")[0] for p in shard.problems()] == [
        " not a JSON object", " no string id", " not a JSON object", " no string id"]
    assert [p.split(" line ")[1].split(":")[0] for p in shard.problems()] == ["4", "5", "6", "7"]
    [described] = [shard.describe_block(0)]
    assert [d[0] for d in described] == ["d0", "d1", "d2", NO_KEY, NO_KEY, NO_KEY, NO_KEY]
    assert described[3][1] == [("json", len(b"{not json"))]
    assert shard.decode_block(0)[0][3] == {"json": b"{not json"}
    [again] = DolmaSource(str(tmp_path)).shards
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        again.restore(state)
    assert len(caplog.records) == 4 and all("\n" not in r.getMessage() for r in caplog.records)
    assert "line 4: not a JSON object" in caplog.records[0].getMessage()


def test_left_out_set_is_one_log_line_per_mount(tmp_path: Path, caplog) -> None:
    make_dataset(tmp_path, 700)
    [shard] = [s for s in DolmaSource(str(tmp_path)).shards if s.name == "wiki"]
    state = shard.prepare()
    [again] = [s for s in DolmaSource(str(tmp_path)).shards if s.name == "wiki"]
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        again.restore(state)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "attribute set 'bad' left out" in lines[0]
    assert "line 601: id 'w601' where" in lines[0] and "has 'w600'" in lines[0]


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_a_cut_file_keeps_its_blocks_before_the_damage(tmp_path: Path, kind: str) -> None:
    rows = docs("d", 3 * LINES_PER_BLOCK)
    path = tmp_path / "documents" / f"a.jsonl.{kind}"
    if kind == "gz":
        write_jsonl(path, rows, "gz")
    else:  # frames of 100 lines each: the cut loses the last frame
        data = [json.dumps(r).encode() + b"\n" for r in rows]
        c = zstandard.ZstdCompressor()
        path.parent.mkdir(parents=True)
        path.write_bytes(b"".join(c.compress(b"".join(data[i:i + 100])) for i in range(0, len(data), 100)))
    whole = path.stat().st_size
    path.write_bytes(path.read_bytes()[:whole - 300])
    [shard] = DolmaSource(str(tmp_path)).shards
    state = shard.prepare()
    problems = shard.problems()
    assert len(problems) == 1 and str(path) in problems[0] and "\n" not in problems[0]
    last = shard.num_blocks - 1
    assert shard.decode_block(0)[0][0]["__key__"] == "d0"
    with pytest.raises(DolmaError) as info:
        shard.decode_block(last)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert shard.describe_block(last) is None
    [again] = DolmaSource(str(tmp_path)).shards
    again.restore(state)
    assert again.decode_block(0)[0] == shard.decode_block(0)[0]
    with pytest.raises(DolmaError):
        again.decode_block(last)


def test_not_gzip_at_all_fails_the_shard_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "documents").mkdir()
    (tmp_path / "documents" / "a.jsonl.gz").write_bytes(b"this is not gzip\n" * 10)
    [shard] = DolmaSource(str(tmp_path)).shards
    with pytest.raises(DolmaError) as info:
        shard.prepare()
    assert "a.jsonl.gz" in str(info.value) and "\n" not in str(info.value)


def test_multi_member_gzip_is_whole(tmp_path: Path) -> None:
    rows = docs("d", 2000)
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    path = tmp_path / "documents" / "a.jsonl.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(gzip.compress(data[i:i + 50000]) for i in range(0, len(data), 50000)))
    [shard] = DolmaSource(str(tmp_path)).shards
    shard.prepare()
    assert shard.problems() == [] and [json.loads(s["json"]) for s in samples_of(shard)] == rows


def test_clashing_names_keep_their_suffix(tmp_path: Path) -> None:
    for relative in ("a.jsonl.gz", "a.jsonl", "b.jsonl", "b/c.jsonl", "d/e.jsonl"):
        write_jsonl(tmp_path / "documents" / relative, docs("x", 2), "gz" if relative.endswith(".gz") else "plain")
    names = [s.name for s in DolmaSource(str(tmp_path)).shards]
    assert names == ["a.jsonl", "a.jsonl.gz", "b.jsonl", "b/c", "d/e"]


def test_every_name_dolma_s_tools_read_is_a_documents_file(tmp_path: Path) -> None:
    """.json, .jsonl, .gz, .zst and .zstd (zstd, as `dolma tag` reads it), whatever comes
    before the compression extension; attributes in the same compression; and a state saved
    for each restores."""
    files = {"a.json": "plain", "b.gz": "gz", "c.json.zstd": "zst", "d.txt.gz": "gz", "e.json.zst": "zst",
             "f.jsonl": "plain", "g.json.gz": "gz"}
    made = {}
    for relative, kind in files.items():
        made[relative] = docs(relative[0], LINES_PER_BLOCK + 3)
        write_jsonl(tmp_path / "documents" / relative, made[relative], kind)
        write_jsonl(tmp_path / "attributes" / "tox" / relative,
                    [{"id": r["id"], "attributes": {"tox": i}} for i, r in enumerate(made[relative])], kind)
    source = DolmaSource(str(tmp_path))
    assert [s.name for s in source.shards] == ["a", "b", "c", "d.txt", "e", "f", "g"]
    assert source.problems() == [] and source.warnings() == []
    states = {}
    for shard in source.shards:
        states[shard.name] = shard.prepare()
        assert shard.problems() == [] and list(shard.attributes) == ["tox"]
        samples = samples_of(shard)
        assert [json.loads(s["json"]) for s in samples] == made[shard.relative]
        assert json.loads(samples[-1]["tox.json"])["attributes"] == {"tox": LINES_PER_BLOCK + 2}
    for shard in DolmaSource(str(tmp_path)).shards:
        shard.restore(states[shard.name])
        assert [json.loads(s["json"]) for s in samples_of(shard)] == made[shard.relative]


def test_reads_from_many_threads_agree_and_keep_few_handles(tmp_path: Path) -> None:
    made = make_dataset(tmp_path, 5 * LINES_PER_BLOCK)
    source = DolmaSource(str(tmp_path))
    for shard in source.shards:
        shard.prepare()
    expected = {(s.name, b): s.decode_block(b)[0] for s in source.shards for b in range(s.num_blocks)}
    for shard in source.shards:
        shard.close()
    dolma_files = source.shards[0]._files
    dolma_files.limit = 2  # fewer handles than files: readers close and reopen under load
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                shard = rng.choice(source.shards)
                block = rng.randrange(shard.num_blocks)
                assert shard.decode_block(block)[0] == expected[(shard.name, block)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    in_threads(work, 8)
    assert errors == []
    assert len(dolma_files._open) <= 2
    assert sum(len(v) for v in made.values()) == sum(len(v) for v in expected.values())


def test_a_random_gzip_read_is_one_seek(tmp_path: Path) -> None:
    make_dataset(tmp_path, 6 * LINES_PER_BLOCK)
    [shard] = [s for s in DolmaSource(str(tmp_path)).shards if s.name == "cc/2019/a"]
    state = shard.prepare()
    [again] = [s for s in DolmaSource(str(tmp_path)).shards if s.name == "cc/2019/a"]
    again.restore(state)
    again.decode_block(4)
    reader = again._readers[again.path]
    assert reader.seeks == 1
