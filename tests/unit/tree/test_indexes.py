"""The loaders' indexes of the tar view (issue #36): energon's <shard>.tar.idx and .nv-meta/,
DALI's <shard>.idx, computed from the tar layouts, never written into the dataset.

Here each file is checked against the exported tars as Python's tarfile reads them, and the
time a cold index takes; the mount's behaviour (options, storage and trust of index.sqlite,
failures) is in tests/mount/test_loader_indexes.py. The same files against the real `energon
prepare` and `wds2idx`, and the real loaders training from a mount, are in
tests/loaders/test_loaders_real.py (marker `loaders`: `make test-loaders`)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
import tarfile
import time
from pathlib import Path

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.indexes import energon
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.tarview import TarView
from loaderdata import export_tars, indexes_dataset, sqlite_rows, view_read


# energon's rules (megatron/energon/flavors/webdataset/config.py), restated to check against
SPLIT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


META = re.compile(r"__[^/]*__($|/)")


def _tarfile_expectations(tar: Path, tar_id: int) -> tuple[bytes, list[str], list[tuple], list[tuple]]:
    """What energon and DALI find in ``tar``, read with tarfile: the .tar.idx, DALI's lines
    (without the name escaping), sample rows and part rows."""
    starts: list[int] = []
    dali: list[list[str]] = []
    samples: list[tuple] = []
    parts: list[tuple] = []
    last_key = last_dali = None
    with tarfile.open(tar) as archive:
        for m in archive:
            base = m.name[m.name.rfind("/") + 1:]
            dot = m.name.find(".", m.name.rfind("/") + 1)
            if base.find(".") > 0:
                entry = f"{m.name[dot + 1:]} {m.offset_data} {m.size} {m.name}"
                if m.name[:dot] != last_dali:
                    dali.append([entry])
                    last_dali = m.name[:dot]
                else:
                    dali[-1].append(entry)
            match = None if META.match(m.name) else SPLIT.match(m.name)
            if match is None:
                continue
            if match.group(1) != last_key:
                starts.append(m.offset)
                samples.append((tar_id, match.group(1), len(samples), m.offset))
                last_key = match.group(1)
            parts.append((tar_id, len(samples) - 1, match.group(2), m.offset_data, m.size))
        end = archive.offset
    ends = [s[3] for s in samples[1:]] + [end]
    samples = [(*s, e - s[3]) for s, e in zip(samples, ends)]
    lines = [f"v1.2 {len(dali)}", *(" ".join(s) for s in dali)]
    return struct.pack(f"<{len(starts) + 1}Q", *starts, end), lines, samples, parts


def test_every_index_agrees_with_the_tars_as_tarfile_reads_them(tmp_path: Path) -> None:
    dataset = indexes_dataset(tmp_path / "ds")
    export_tars(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    names = [n for n, _, _ in view.names("/")]
    assert names == ["0.tar", "1.tar", "2.tar", "shards.json", "0.tar.idx", "0.idx", "1.tar.idx", "1.idx",
                     "2.tar.idx", "2.idx", ".nv-meta"]
    assert [n for n, _, _ in view.names("/.nv-meta")] == [".info.json", "split.yaml", "dataset.yaml",
                                                           "index.sqlite", "index.uuid"]
    all_samples: list[tuple] = []
    all_parts: list[tuple] = []
    counts = {}
    for tar_id, shard in enumerate("012"):
        tar_idx, dali_lines, samples, parts = _tarfile_expectations(tmp_path / "out" / f"{shard}.tar", tar_id)
        assert view_read(view, f"/{shard}.tar.idx") == tar_idx
        assert view_read(view, f"/{shard}.idx").decode().split("\n") == [*dali_lines, ""]
        all_samples += samples
        all_parts += parts
        counts[f"{shard}.tar"] = len(samples)
    assert counts == {"0.tar": 50, "1.tar": 50, "2.tar": 20}
    info = json.loads(view_read(view, "/.nv-meta/.info.json"))
    assert info == {"energon_version": "7.4.1", "shard_counts": counts}
    assert view_read(view, "/.nv-meta/split.yaml") == b"split_parts:\n  train:\n  - '{0..2}.tar'\nexclude: []\n"
    assert view_read(view, "/.nv-meta/dataset.yaml") == b"__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    (tmp_path / "index.sqlite").write_bytes(view_read(view, "/.nv-meta/index.sqlite"))
    schema, samples, parts = sqlite_rows(tmp_path / "index.sqlite")
    assert [(kind, name) for kind, name, _, _ in schema] == list(energon.SCHEMA)
    assert samples == sorted(all_samples) and parts == sorted(all_parts)
    uuid = view_read(view, "/.nv-meta/index.uuid")
    assert re.fullmatch(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid)
    assert view_read(TarView(BlockTree(AtlasDataset(dataset))), "/.nv-meta/index.uuid") == uuid  # stable


def test_names_as_energon_and_wds2idx_split_them() -> None:
    assert energon.split_member("a/b.c.d") == ("a/b", "c.d")
    assert energon.split_member("a.b/c") is None and energon.split_member("__x__/a.json") is None
    assert energon.tar_order(["a-b.tar", "a/b.tar", "10.tar", "9.tar"]) == ["10.tar", "9.tar", "a/b.tar", "a-b.tar"]
    assert energon.collapse(["0.tar", "1.tar", "2.tar", "x.tar", "04.tar", "05.tar", "7.tar"]) == [
        "{0..2}.tar", "x.tar", "{04..05}.tar", "7.tar"]
    assert energon.split_by_ratio([f"{i}.tar" for i in range(5)], (1, 1, 1)) == {
        "train": ["0.tar"], "val": ["1.tar", "2.tar"], "test": ["3.tar", "4.tar"]}
    from atlasfs.tree.indexes import dali
    assert dali.split_name("a/b.c.d") == ("a/b", "c.d") and dali.split_name("a/bc") == ("a/b", "a/bc")
    assert dali.tar_printed("ü\\a\tb") == "ü\\\\a\\tb" and dali.tar_printed("x\udcff") == "x\\377"


def test_each_index_of_a_2500_sample_shard_served_cold_then_from_memory(tmp_path: Path) -> None:
    dataset = tmp_path / "big"
    rng = random.Random(3)
    with AtlasWriter(dataset, shard_size=2500, block_size=50, compression_strategy=1) as writer:
        for i in range(2500):
            writer.add_example({"__key__": f"s{i:05d}", "jpg": rng.randbytes(2000), "cls": i, "json": {"i": i}})
    times = {}
    for path in ("/0.tar.idx", "/0.idx", "/.nv-meta/.info.json", "/.nv-meta/index.sqlite"):
        source = open_source(str(dataset), None, SourceOptions())
        view = TarView(BlockTree(source, store=TableStore(str(dataset), index_dir=str(tmp_path / f"t{len(times)}"))),
                       store=TableStore(str(dataset), index_dir=str(tmp_path / f"t{len(times)}")))
        start = time.perf_counter()
        data = view_read(view, path)  # cold: no table stored, the shard decoded and sized to lay it out
        times[path] = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(10):
            assert view_read(view, path) == data
        times[path + " again"] = (time.perf_counter() - start) / 10
        view.loaders.close()
    # A guard against a hang or a pass per request, not the 1 s target: a timed unit
    # test is no measurement (CI failed it at 4.7 s with a Ray driver in the process). The
    # target is measured through real mounts by bench/indexes.py (bench/results/indexes/).
    assert all(t < 10.0 for t in times.values()), times
    assert all(times[p + " again"] < 0.05 for p in ("/0.tar.idx", "/0.idx", "/.nv-meta/.info.json")), times
    digest = hashlib.sha256(data).hexdigest()
    assert digest  # the sqlite read back whole


def test_members_split_as_energon_s_regexes_split_them() -> None:
    """The split's fast path (a key before the first dot of the last part) gives what energon's
    regexes give, for every name of up to 6 characters of ``a._/`` and a newline (a tar member's
    name may hold one; the regexes' ``.`` does not match it) and a few longer ones."""
    import itertools

    def regex(name: str) -> tuple[str, str] | None:
        if META.match(name):
            return None
        match = SPLIT.match(name)
        return None if match is None else (match.group(1), match.group(2))

    names = ["".join(chars) for n in range(1, 7) for chars in itertools.product("a._/\n", repeat=n)]
    names += ["x/.y", "x.z/.y", "__meta__/a.json", "__a.b", "a__x__/b.c", "ü/ß.jpg", "a/b/c.d.e", "k.tar.gz"]
    assert [energon.split_member(n) for n in names] == [regex(n) for n in names]


class _Names:
    """A layout of names only, for energon.counted."""

    def __init__(self, names: list[str]) -> None:
        self._names = names

    def names(self) -> list[str]:
        return list(self._names)


def _counted_one_by_one(names: list[str]) -> tuple[list[int], list[int], list[str], list[str], list[int]]:
    member, sample, parts, keys, firsts = [], [], [], [], []
    for i, name in enumerate(names):
        split = energon.split_member(name)
        if split is None:
            continue
        if not keys or split[0] != keys[-1]:
            keys.append(split[0])
            firsts.append(i)
        member.append(i)
        sample.append(len(keys) - 1)
        parts.append(split[1])
    return member, sample, parts, keys, firsts


def test_counted_at_once_is_counted_one_name_at_a_time() -> None:
    """The usual tar's names are split all at once (energon._counted_plain); any other name
    sends the whole tar through split_member one name at a time: the same members either way."""
    rng = random.Random(7)
    odd = ["__meta__.json", "_.x", "__x.y", ".hidden", "nodot", "a..b", "k.tar.gz", "é.jpg", "a\nb.c", "d/e.f",
           "x\0.y", "x.\0", "0001.", "__.__"]
    cases: list[list[str]] = [[], ["a.jpg"], [f"{i // 3:04d}.{('jpg', 'cls', 'json')[i % 3]}" for i in range(30)]]
    for _ in range(300):
        cases.append([rng.choice([f"{rng.randrange(5)}.{rng.choice('ab')}", *odd]) for _ in range(rng.randrange(1, 12))])
    for names in cases:
        found = energon.counted(_Names(names))  # type: ignore[arg-type]
        got = (found.member.tolist(), found.sample.tolist(), found.parts, found.keys, found.firsts.tolist())
        assert got == _counted_one_by_one(names), names
