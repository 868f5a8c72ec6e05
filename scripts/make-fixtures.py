#!/usr/bin/env python3
"""Regenerate the conformance corpus: tests/fixtures/{dolma,lavender,modalities,webdataset}/.

Every dataset there is written by the REAL producer tool, installed at a pinned version in a
throwaway virtualenv (``python3 -m venv``, packages from the registry), and every
``expected.json`` is what that tool's OWN reading code returns for it. CI never runs this
script: the tests only use the committed files (tests/unit/formats/test_fixtures_corpus.py
checks they are intact). Usage::

    python3 scripts/make-fixtures.py                 # all four tools
    python3 scripts/make-fixtures.py modalities      # one tool
    python3 scripts/make-fixtures.py --venvs /tmp/v  # where the virtualenvs go (kept for reuse)

The script runs itself inside each tool's virtualenv (``--inside <tool> <out>``); the parts that
run there import only the standard library and that tool (plus what it needs).

JSON encoding of values in every expected.json (JSON has no bytes, arrays or NaN):
``{"$bytes": "<base64>"}`` bytes; ``{"$npy": "<base64 of numpy.save() bytes>"}`` a numpy array;
``{"$float": "nan"}`` a NaN. Everything else is plain JSON.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

#: Per tool: the pip requirement lines installed into its virtualenv, in order (one pip call per
#: line group), and which distributions to report versions of.
TOOLS: dict[str, dict] = {
    "webdataset": {
        "pip": [["webdataset==1.0.2", "pillow"]],
        "report": ["webdataset", "pillow", "numpy"],
    },
    "lavender": {
        # tqdm: lavender_data.storage.http imports it but lavender-data 0.1.10 does not declare it
        "pip": [["lavender-data==0.1.10", "webdataset==1.0.2", "pillow", "tqdm"]],
        "report": ["lavender-data", "pyarrow", "numpy", "webdataset", "pillow"],
    },
    "modalities": {
        # --no-deps: Modalities pulls torch/transformers/wandb; its packer needs none of them
        # once their imports are stubbed and a tokenizer object is passed in.
        "pip": [["--no-deps", "modalities==0.5.0"], ["numpy", "jq", "tqdm", "pydantic"]],
        "report": ["modalities", "numpy", "jq", "tqdm", "pydantic"],
    },
    "dolma": {
        # dolma pins s3fs==2023.6.0 (-> aiobotocore 2.5.x); without pinning boto3/botocore to
        # the matching release pip backtracks through every boto3 release for minutes.
        # smart-open: 9.x opens .zst with backports.zstd, which nothing installs (dolma tag then
        # fails: "No module named 'backports'"); 7.1.0 opens .zst with zstandard.
        "pip": [["dolma==1.2.1", "numpy<2", "smart-open==7.1.0", "aiobotocore==2.5.0",
                 "botocore==1.29.76", "boto3==1.26.76"]],
        "report": ["dolma", "numpy", "smart-open", "zstandard", "msgspec"],
    },
}


# ---------------------------------------------------------------------------------------------
# helpers shared by the inside parts (standard library only; numpy imported when present)
# ---------------------------------------------------------------------------------------------

def enc(value):
    """A value as JSON-able data, with the tagged forms the module docstring describes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, float) and math.isnan(value):
        return {"$float": "nan"}
    if isinstance(value, dict):
        return {str(k): enc(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [enc(v) for v in value]
    mod = type(value).__module__
    if mod == "numpy" and type(value).__name__ == "ndarray":
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return {"$npy": base64.b64encode(buf.getvalue()).decode("ascii")}
    if mod == "numpy":  # numpy scalar
        return enc(value.item())
    return value


def versions(names: list[str]) -> dict[str, str]:
    """Installed versions of the named distributions (from the running interpreter)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = "not installed"
    return out


def dump(path: Path, data) -> None:
    """Write JSON with sorted-free, stable formatting (order is meaningful: documents, samples)."""
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def run(cmd: list[str], log: list[str], **kw) -> None:
    """Run a command, recording it (for the README) and echoing it (for the user)."""
    shown = " ".join(cmd)
    print(f"  $ {shown}", flush=True)
    log.append(shown)
    subprocess.run(cmd, check=True, **kw)


def tree_files(root: Path) -> list[str]:
    """Relative paths of every file under root, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# webdataset
# ---------------------------------------------------------------------------------------------

def tiny_png(w: int, h: int, seed: int) -> bytes:
    """PNG bytes of a small deterministic RGB image, encoded by Pillow."""
    from PIL import Image

    img = Image.new("RGB", (w, h))
    img.putdata([((x * 37 + seed) % 256, (y * 59 + seed) % 256, (x * y + seed) % 256)
                 for y in range(h) for x in range(w)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def tiny_jpeg(w: int, h: int, seed: int) -> bytes:
    """JPEG bytes of a small deterministic image, encoded by Pillow."""
    from PIL import Image

    img = Image.new("RGB", (w, h), ((seed * 40) % 256, 120, 200))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def make_webdataset(out: Path) -> dict:
    """Two sets written by webdataset.ShardWriter, read back by webdataset.WebDataset."""
    import webdataset as wds

    code: list[str] = []
    sets = {
        "images": [
            {"__key__": f"img{i:04d}", "png" if i % 2 == 0 else "jpg":
             tiny_png(8, 6, i) if i % 2 == 0 else tiny_jpeg(8, 8, i),
             "cls": str(i % 3).encode(), "json": json.dumps({"caption": f"picture {i}", "i": i}).encode()}
            for i in range(5)
        ],
        "tiny": [
            {"__key__": f"doc/{i:03d}", "txt": (f"document {i} " * 100)[:1024].encode(),
             "json": json.dumps({"id": i, "lang": "en", "text": "é" * (i + 1)}).encode()}
            for i in range(6)
        ],
    }
    maxcount = {"images": 3, "tiny": 3}
    for name, samples in sets.items():
        data = out / name / "data"
        data.mkdir(parents=True)
        pattern = str(data / f"{name}-%06d.tar")
        code.append(f"webdataset.ShardWriter({name}-%06d.tar, maxcount={maxcount[name]}).write(s) "
                    f"for each of {len(samples)} samples")
        with wds.ShardWriter(pattern, maxcount=maxcount[name]) as sink:
            for s in samples:
                sink.write(s)
        urls = sorted(str(p) for p in data.glob("*.tar"))
        # The reader: WebDataset over the shards in order, no shuffling, no decoding.
        got = []
        for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            rec = {k: v for k, v in s.items() if k != "__url__"}
            for k in ("__url__", "__local_path__"):  # absolute paths of this run: made relative
                if k in s:
                    rec[k] = os.path.relpath(s[k], out / name)
            got.append(rec)
        dump(out / name / "expected.json", {
            "reader": "webdataset.WebDataset(sorted shard paths, shardshuffle=False) without decoders; "
                      "__url__ and __local_path__ made relative to this folder",
            "shards": [os.path.relpath(u, out / name) for u in urls],
            "samples": enc(got),
        })
    return {"code": code}


# ---------------------------------------------------------------------------------------------
# lavender-data
# ---------------------------------------------------------------------------------------------

def make_lavender(out: Path) -> dict:
    """Shardsets written by lavender-data's converters and preprocess writer; read by its
    ServerSideReader (the reader the server iterates with) and its deserializer."""
    import warnings

    import numpy as np
    import webdataset as wds
    from lavender_data.client.converters import PlainConverter, WebDatasetConverter
    from lavender_data.serialize import deserialize_ndarray, serialize_ndarray
    from lavender_data.server.reader import (GlobalSampleIndex, InnerJoinSampleInsufficient,
                                             MainShardInfo, ServerSideReader, ShardInfo)
    from lavender_data.server.shardset.preprocess import _export_shard
    from lavender_data.shard import inspect_shard

    code: list[str] = []

    # -- dataset 1: from WebDataset tars, uid "__key__" --------------------------------------
    root = out / "wds_images"
    src = Path(tempfile.mkdtemp(prefix="lav-wds-"))
    with wds.ShardWriter(str(src / "src-%06d.tar"), maxcount=10) as sink:
        for i in range(5):
            sink.write({"__key__": f"s{i:03d}", "png": tiny_png(4, 3, i), "cls": str(i % 2).encode(),
                        "json": json.dumps({"caption": f"cap {i}", "score": i / 4}).encode()})
    main = root / "data" / "main"
    main.mkdir(parents=True)
    ds = wds.WebDataset(sorted(str(p) for p in src.glob("*.tar")), shardshuffle=False,
                        empty_check=False).decode("pil")
    WebDatasetConverter(max_workers=1).to_shardset(ds, "wds_images", f"file://{main}", samples_per_shard=3)
    code.append("WebDatasetConverter(max_workers=1).to_shardset(webdataset.WebDataset(src tars, "
                "shardshuffle=False).decode('pil'), 'wds_images', 'file://<out>/wds_images/data/main', "
                "samples_per_shard=3)  # 5 samples: png (PIL image -> serialize_ndarray), cls, json")
    # A feature shardset as lavender's preprocess writes it (_export_shard is what
    # preprocess_shardset calls per shard): a computed ndarray column, one shard per main shard.
    feat = root / "data" / "features"
    feat.mkdir(parents=True)
    for shard, keys in enumerate([["s000", "s001", "s002"], ["s003", "s004"]]):
        rows = [{"__key__": k, "mean_rgb": serialize_ndarray(np.array([i, i + 0.5, -i], dtype="<f4")),
                 "n": i * 10} for i, k in [(int(k[1:]), k) for k in keys]]
        _export_shard(rows, f"file://{feat}/shard.{shard:05d}.parquet")
    code.append("lavender_data.server.shardset.preprocess._export_shard(rows, "
                "'file://<out>/wds_images/data/features/shard.0000N.parquet') for 2 shards; rows: __key__, "
                "mean_rgb = serialize_ndarray(float32[3]), n")
    shutil.rmtree(src)

    # -- dataset 2: uid "id", parquet main shardset + csv feature shardset missing a row -------
    root2 = out / "tabular"
    main2 = root2 / "data" / "main"
    main2.mkdir(parents=True)
    conv = PlainConverter(max_workers=1)
    rows = [{"id": i, "text": f"row {i} ✓", "image_png": tiny_png(3, 2, 50 + i),
             "tokens": serialize_ndarray(np.arange(i + 1, dtype="<i8") * 1000)} for i in range(6)]
    conv.to_shard(rows[:3], f"file://{main2}", 0)
    conv.to_shard(rows[3:], f"file://{main2}", 1)
    code.append("PlainConverter(max_workers=1).to_shard(rows[:3], 'file://<out>/tabular/data/main', 0); "
                ".to_shard(rows[3:], ..., 1)  # id int, text str, image_png PNG bytes, "
                "tokens = serialize_ndarray(int64[i+1])")
    # lavender-data has no csv writer: csv shardsets are files users write; this one is written
    # with Python's csv module the way its docs show (header row, one row per sample).
    import csv

    side = root2 / "data" / "labels"
    side.mkdir(parents=True)
    for shard, ids in enumerate([[0, 1, 2], [3, 5]]):  # id 4 is missing from shard 1
        with open(side / f"shard.{shard:05d}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "label", "weight"])
            for i in ids:
                w.writerow([i, f"label-{i}", i * 1.5])
    code.append("csv.writer -> tabular/data/labels/shard.00000.csv (ids 0,1,2) and shard.00001.csv "
                "(ids 3,5: id 4 missing); header id,label,weight")

    # -- expected readings --------------------------------------------------------------------
    cache = Path(tempfile.mkdtemp(prefix="lav-cache-"))
    reader = ServerSideReader(disk_cache_size=1 << 30, dirname=str(cache))

    def shardset_info(ss_dir: Path, ss_id: str) -> tuple[list, dict]:
        # As lavender's sync does: shard index = position in the sorted file list; columns
        # from inspecting the first shard (a csv's columns are all "string").
        shards = []
        columns = None
        for idx, p in enumerate(sorted(ss_dir.iterdir())):
            info = inspect_shard("file://" + str(p), known_columns=columns)
            columns = columns or info.columns
            shards.append({"index": idx, "file": p.name, "format": info.format,
                           "samples": info.samples, "filesize": info.filesize,
                           "location": "file://" + str(p)})
        return shards, dict(columns)

    def read_dataset(root: Path, uid: str, uid_type: str, main_name: str, feature_names: list[str]):
        main_shards, main_cols = shardset_info(root / "data" / main_name, main_name)
        feats = {n: shardset_info(root / "data" / n, n) for n in feature_names}
        samples = []
        g = 0
        for ms in main_shards:
            fshards = []
            for n, (shards, cols) in feats.items():
                fs = next(s for s in shards if s["index"] == ms["index"])
                fshards.append(ShardInfo(shardset_id=n, index=fs["index"], samples=fs["samples"],
                                         location=fs["location"], format=fs["format"],
                                         filesize=fs["filesize"], columns=cols))
            for si in range(ms["samples"]):
                gi = GlobalSampleIndex(
                    index=g, uid_column_name=uid, uid_column_type=uid_type,
                    main_shard=MainShardInfo(sample_index=si, shardset_id=main_name,
                                             index=ms["index"], samples=ms["samples"],
                                             location=ms["location"], format=ms["format"],
                                             filesize=ms["filesize"], columns=main_cols),
                    feature_shards=fshards)
                rec = {"index": g, "shard": ms["index"], "sample_index": si}
                for join in ("inner", "left"):
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            s = reader.get_sample(gi, join=join)
                        rec[join] = dict(s)
                    except InnerJoinSampleInsufficient as e:
                        msg = str(e).replace(f"file://{out}/", "file://<out>/")
                        rec[join] = {"$error": f"InnerJoinSampleInsufficient: {msg}"}
                rec["uid"] = rec["left"][uid]
                # the ndarray columns, decoded by lavender's own deserializer
                nd = {k: deserialize_ndarray(v) for k, v in rec["left"].items()
                      if k in ("png", "mean_rgb", "tokens") and isinstance(v, bytes) and v}
                rec["deserialized"] = nd
                samples.append(rec)
                g += 1
        for info in (main_shards, *[v[0] for v in feats.values()]):
            for s in info:
                s["location"] = os.path.relpath(s["location"][len("file://"):], root)
        return {
            "uid_column": uid, "uid_column_type": uid_type, "main_shardset": main_name,
            "shardsets": {main_name: {"columns": main_cols, "shards": main_shards},
                          **{n: {"columns": c, "shards": s} for n, (s, c) in feats.items()}},
            "samples": enc(samples),
        }

    reader_doc = ("lavender_data.server.reader.ServerSideReader.get_sample(GlobalSampleIndex, "
                  "join='inner'|'left') per main-shardset sample; shard indices and columns from "
                  "lavender_data.shard.inspect_shard per file (as its shardset sync does); "
                  "'deserialized' = lavender_data.serialize.deserialize_ndarray of the ndarray columns")
    for name, uid, uid_type, main_name, feats in (
            ("wds_images", "__key__", "string", "main", ["features"]),
            ("tabular", "id", "int64", "main", ["labels"])):
        data = read_dataset(out / name, uid, uid_type, main_name, feats)
        data["reader"] = reader_doc
        dump(out / name / "expected.json", data)
    shutil.rmtree(cache)
    return {"code": code}


# ---------------------------------------------------------------------------------------------
# Modalities
# ---------------------------------------------------------------------------------------------

def stub_torch_transformers() -> None:
    """Stand-ins for the modules Modalities imports but its packer and reader never use:
    torch (logger's distributed check, Dataset base class), transformers (BatchEncoding, a
    dict; AutoTokenizer) and sentencepiece."""
    import types

    torch = types.ModuleType("torch")
    torch.distributed = types.SimpleNamespace(is_initialized=lambda: False)
    utils = types.ModuleType("torch.utils")
    data = types.ModuleType("torch.utils.data")
    dataset = types.ModuleType("torch.utils.data.dataset")

    class Dataset:  # torch.utils.data.Dataset is a plain base class
        pass

    dataset.Dataset = Dataset
    data.dataset = dataset
    utils.data = data
    torch.utils = utils
    transformers = types.ModuleType("transformers")

    class BatchEncoding(dict):
        def __init__(self, data=None):
            super().__init__(data or {})

    transformers.BatchEncoding = BatchEncoding
    transformers.AutoTokenizer = object
    sp = types.ModuleType("sentencepiece")
    sys.modules.update({"torch": torch, "torch.utils": utils, "torch.utils.data": data,
                        "torch.utils.data.dataset": dataset, "transformers": transformers,
                        "sentencepiece": sp})


MOD_DOCS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "ünïcödé wörds ✓ and emoji 🙂",
    "a",
    "one two three four five six seven eight nine ten eleven twelve",
    "last document, with punctuation; and more!",
]


def make_modalities(out: Path) -> dict:
    """create_raw_index + pack_encoded_data (IndexGenerator + PackedDataGenerator) at each token
    width, and a file merged by join_embedded_stream_data; read by PackedMemMapDatasetBase."""
    stub_torch_transformers()
    import zlib

    from modalities.dataloader.create_index import IndexGenerator
    from modalities.dataloader.create_packed_data import (EmbeddedStreamData, PackedDataGenerator,
                                                          join_embedded_stream_data)
    from modalities.dataloader.dataset import PackedMemMapDatasetBase
    from modalities.tokenization.tokenizer_wrapper import TokenizerWrapper

    class WordHashTokenizer(TokenizerWrapper):
        """Deterministic tokenizer: one token per whitespace word, crc32(word) mod (vocab-1);
        the end-of-document token is vocab-1. Passed to the packer as an object."""

        def __init__(self, vocab: int):
            self._vocab = vocab

        def tokenize(self, text: str) -> list[int]:
            return [zlib.crc32(w.encode()) % (self._vocab - 1) for w in text.split()]

        @property
        def vocab_size(self) -> int:
            return self._vocab

        def get_token_id(self, token: str) -> int:
            assert token == "<eod>"
            return self._vocab - 1

    code: list[str] = []

    def write_jsonl(path: Path, docs: list[str]) -> None:
        path.write_text("".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n"
                                for i, t in enumerate(docs)), encoding="utf-8")

    def pack(src_jsonl: Path, idx: Path, dst: Path, vocab: int) -> None:
        IndexGenerator(src_jsonl).create_index(idx)  # = modalities data create_raw_index
        PackedDataGenerator(src_jsonl, tokenizer=WordHashTokenizer(vocab), eod_token="<eod>",
                            number_of_processes=1, jq_pattern=".text", processing_batch_size=2,
                            raw_samples_queue_size=8, processed_samples_queue_size=8,
                            index_path=idx).run(dst)  # = modalities data pack_encoded_data

    def reading(path: Path) -> dict:
        ds = PackedMemMapDatasetBase(path, sample_key="input_ids")
        esd = EmbeddedStreamData(path)
        return {
            "file": path.name,
            "header": {"data_len": esd.data_len, "token_size_in_bytes": esd.token_size_in_bytes},
            "index": [list(e) for e in esd.index_base],
            "documents": [ds[i]["input_ids"].tolist() for i in range(len(ds))],
            "dtype_in_ram": str(ds[0]["input_ids"].dtype) if len(ds) else None,
        }

    def tokens_of(docs: list[str], vocab: int) -> list[list[int]]:
        tok = WordHashTokenizer(vocab)
        return [tok.tokenize(t) + [vocab - 1] for t in docs]

    # -- one file per token width -------------------------------------------------------------
    wroot = out / "widths"
    (wroot / "data").mkdir(parents=True)
    (wroot / "src").mkdir()
    write_jsonl(wroot / "src" / "docs.jsonl", MOD_DOCS)
    widths = {}
    for width, vocab in ((1, 256), (2, 50257), (4, 100000)):
        dst = wroot / "data" / f"w{width}.pbin"
        pack(wroot / "src" / "docs.jsonl", wroot / "src" / f"w{width}.idx", dst, vocab)
        r = reading(dst)
        assert r["header"]["token_size_in_bytes"] == width, r["header"]
        r["vocab_size"] = vocab
        r["tokenizer_output"] = tokens_of(MOD_DOCS, vocab)
        widths[f"w{width}"] = r
        code.append(f"IndexGenerator(src/docs.jsonl).create_index(src/w{width}.idx); "
                    f"PackedDataGenerator(src/docs.jsonl, tokenizer=WordHashTokenizer({vocab}), "
                    f"eod_token='<eod>', number_of_processes=1, jq_pattern='.text', "
                    f"processing_batch_size=2, raw_samples_queue_size=8, "
                    f"processed_samples_queue_size=8, index_path=src/w{width}.idx).run(data/w{width}.pbin)")
    dump(wroot / "expected.json", {
        "reader": "modalities.dataloader.dataset.PackedMemMapDatasetBase(path, "
                  "sample_key='input_ids')[i]['input_ids'].tolist(); header and index from "
                  "EmbeddedStreamData(path)",
        "files": widths,
    })

    # -- merged file ----------------------------------------------------------------------------
    mroot = out / "merged"
    for d in ("data", "parts", "src"):
        (mroot / d).mkdir(parents=True)
    groups = {"part-a": MOD_DOCS[:2], "part-b": MOD_DOCS[2:4], "part-c": MOD_DOCS[4:]}
    parts = {}
    for name, docs in groups.items():
        write_jsonl(mroot / "src" / f"{name}.jsonl", docs)
        pack(mroot / "src" / f"{name}.jsonl", mroot / "src" / f"{name}.idx",
             mroot / "parts" / f"{name}.pbin", 50257)
        parts[name] = reading(mroot / "parts" / f"{name}.pbin")
        parts[name]["tokenizer_output"] = tokens_of(docs, 50257)
    code.append("the same create_index + PackedDataGenerator (vocab 50257, 2-byte tokens) for "
                "src/part-{a,b,c}.jsonl -> parts/part-{a,b,c}.pbin")
    merged = mroot / "data" / "merged.pbin"
    join_embedded_stream_data([EmbeddedStreamData(mroot / "parts" / f"{n}.pbin") for n in groups],
                              merged)  # = modalities data merge_packed_data
    code.append("join_embedded_stream_data([EmbeddedStreamData(parts/part-a.pbin), ...b, ...c], "
                "data/merged.pbin)  # = modalities data merge_packed_data / merge_packed_data_files")
    m = reading(merged)
    parts_docs = [d for n in groups for d in parts[n]["documents"]]
    # Where each document really is in the merged data section: the parts' data sections are
    # concatenated, so part k's offsets should move by the sum of the earlier parts' data_len.
    correct_index = []
    base = 0
    for n in groups:
        correct_index += [[o + base, ln] for o, ln in parts[n]["index"]]
        base += parts[n]["header"]["data_len"]
    m["parts_documents"] = parts_docs
    m["index_if_offsets_were_shifted_by_data_len_only"] = correct_index
    m["documents_equal_parts"] = [a == b for a, b in zip(m["documents"], parts_docs)]
    m["index_minus_correct"] = [a[0] - b[0] for a, b in zip(m["index"], correct_index)]
    dump(mroot / "expected.json", {
        "reader": "as for widths/ (PackedMemMapDatasetBase / EmbeddedStreamData)",
        "parts": parts,
        "merged": m,
    })
    return {"code": code}


# ---------------------------------------------------------------------------------------------
# dolma
# ---------------------------------------------------------------------------------------------

DOLMA_DOCS = {
    "cc/2019-09/part-a.json.gz": [
        "Short one.",
        "A much longer common crawl document that goes on for a while, long enough to pass.",
        "Paragraph one.\nParagraph two is here.\n\nParagraph four after a blank line.",
    ],
    "cc/2019-10/part-b.jsonl.zst": [
        "zstd compressed document number one, which is also fairly long indeed.",
        "tiny",
        "ünïcödé text ✓ with emoji 🙂 and enough characters to be kept by the filter.",
    ],
    "wiki/en/0000.jsonl.gz": [
        "Wikipedia is a free online encyclopedia written by volunteers around the world.",
        "Stub.",
    ],
}


def make_dolma(out: Path) -> dict:
    """Documents in nested folders (.json.gz and .jsonl.zst), tagged with `dolma tag` and mixed
    with `dolma mix`; read back the way dolma reads them (smart_open with dolma's
    compressors, one JSON object per line; attributes aligned line by line)."""
    import gzip

    import dolma  # noqa: F401  (registers dolma's .zst/.zstd smart_open compressors)
    import smart_open
    import zstandard

    code: list[str] = []
    dolma_bin = str(Path(sys.executable).parent / "dolma")
    root = out / "tagged" / "data"
    for rel, texts in DOLMA_DOCS.items():
        p = root / "documents" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        src = rel.split("/")[0]
        lines = "".join(json.dumps({"id": f"{Path(rel).name.split('.')[0]}-{i}", "text": t,
                                    "source": src, "added": "2024-01-01T00:00:00Z",
                                    "metadata": {"n": i}}, ensure_ascii=False) + "\n"
                        for i, t in enumerate(texts)).encode()
        if rel.endswith(".gz"):
            p.write_bytes(gzip.compress(lines, mtime=0))
        else:
            p.write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    code.append("input documents: written by this script (gzip mtime=0 / zstandard level 3), "
                "one JSON object per line with id, text, source, added, metadata")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    docs_glob = str(root / "documents" / "*" / "*" / "*")
    run([dolma_bin, "tag", "--documents", docs_glob, "--experiment", "basic",
         "--taggers", "char_length_v1", "random_number_v1", "--processes", "1"], code, env=env)
    run([dolma_bin, "tag", "--documents", docs_glob,
         "--taggers", "char_length_with_paragraphs_v1", "--processes", "1"], code, env=env)
    mix_out = out / "mixed" / "data" / "documents"
    cfg = {
        "streams": [{
            "name": "cc-wiki-long",
            "documents": [docs_glob],
            "attributes": ["basic", "char_length_with_paragraphs_v1"],
            "output": {"path": str(mix_out), "max_size_in_bytes": 400},
            "filter": {"include": ["$.attributes[?(@.basic__char_length_v1__length[0][2] >= 40)]"],
                       "syntax": "jsonpath"},
        }],
        "processes": 1,
    }
    cfg_path = out / "mix.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    run([dolma_bin, "-c", str(cfg_path), "mix"], code, env=env)
    code.append("mix config: " + json.dumps(cfg).replace(str(out), "<out>"))
    cfg_path.unlink()
    # The tag step leaves its work dirs somewhere temporary; nothing else must be in the tree.

    def read_lines(path: Path) -> list:
        with smart_open.open(str(path), "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def attribute_sets(data_root: Path) -> list[str]:
        a = data_root / "attributes"
        return sorted(p.name for p in a.iterdir()) if a.is_dir() else []

    def reading(data_root: Path) -> dict:
        files = {}
        for doc in sorted((data_root / "documents").rglob("*")):
            if not doc.is_file():
                continue
            rel = str(doc.relative_to(data_root))
            entry = {"documents": read_lines(doc), "attributes": {}}
            for name in attribute_sets(data_root):
                # dolma mix's rule: the attribute file is the document path with
                # "/documents/" replaced by "/attributes/<name>/" (same name and extension)
                ap = Path(str(doc).replace("/documents/", f"/attributes/{name}/"))
                attrs = read_lines(ap)
                assert [a["id"] for a in attrs] == [d["id"] for d in entry["documents"]], ap
                entry["attributes"][name] = {"file": str(ap.relative_to(data_root)),
                                             "rows": attrs}
            files[rel] = entry
        return {"layout": tree_files(data_root), "files": files}

    reader_doc = ("smart_open.open(path, 'rt', encoding='utf-8') after `import dolma` (dolma's "
                  "tagger reads documents this way; compression from the extension), "
                  "json.loads per line; attribute file = document path with '/documents/' -> "
                  "'/attributes/<name>/' (dolma mix's rule), rows checked aligned by id")
    for name in ("tagged", "mixed"):
        r = reading(out / name / "data")
        r["reader"] = reader_doc
        dump(out / name / "expected.json", r)
    return {"code": code}


MAKERS = {"webdataset": make_webdataset, "lavender": make_lavender,
          "modalities": make_modalities, "dolma": make_dolma}


# ---------------------------------------------------------------------------------------------
# driver (system python)
# ---------------------------------------------------------------------------------------------

def inside(tool: str, out: Path) -> None:
    """Run one tool's maker in this interpreter (the tool's virtualenv) and write meta.json."""
    out.mkdir(parents=True, exist_ok=True)
    info = MAKERS[tool](out)
    info["code"] = [c.replace(str(out), "<out>") for c in info["code"]]
    info["versions"] = versions(TOOLS[tool]["report"])
    (out / ".meta.json").write_text(json.dumps(info, indent=1))


def write_manifest(folder: Path) -> None:
    """manifest.json: size and sha256 of every file of the format's folder but itself."""
    files = {}
    for rel in tree_files(folder):
        if rel == "manifest.json":
            continue
        b = (folder / rel).read_bytes()
        files[rel] = {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    dump(folder / "manifest.json", {"files": files})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tools", nargs="*", help=f"any of {', '.join(TOOLS)} (default: all)")
    ap.add_argument("--venvs", default="/tmp/atlasfs-fixture-venvs", type=Path)
    ap.add_argument("--inside", nargs=2, metavar=("TOOL", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inside:
        inside(a.inside[0], Path(a.inside[1]))
        return
    unknown = sorted(set(a.tools) - set(TOOLS))
    if unknown:
        ap.error(f"unknown tool(s): {', '.join(unknown)}")
    for tool in a.tools or list(TOOLS):
        venv = a.venvs / tool
        print(f"== {tool}: virtualenv {venv}", flush=True)
        log: list[str] = []
        if not (venv / "bin" / "python").exists():
            run([sys.executable, "-m", "venv", str(venv)], log)
        else:
            log.append(f"{sys.executable} -m venv {venv}   # (made by an earlier run, reused)")
        for group in TOOLS[tool]["pip"]:
            run([str(venv / "bin" / "pip"), "install", "-q", *group], log)
        tmp = Path(tempfile.mkdtemp(prefix=f"atlasfs-fixture-{tool}-"))
        try:
            run([str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--inside", tool,
                 str(tmp / "out")], log, cwd=tmp)
            meta = json.loads((tmp / "out" / ".meta.json").read_text())
            (tmp / "out" / ".meta.json").unlink()
            dest = FIXTURES / tool
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(tmp / "out", dest)
        finally:
            shutil.rmtree(tmp)
        write_readme(dest, tool, meta, [c.replace(str(tmp), "<tmp>") for c in log])
        write_manifest(dest)
        vs = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        print(f"   {tool}: {vs}\n   wrote {dest} ({sum(p.stat().st_size for p in dest.rglob('*') if p.is_file())} bytes)")


def write_readme(dest: Path, tool: str, meta: dict, log: list[str]) -> None:
    """The folder's README: tool, versions, commands and code, then the format's notes."""
    notes = (Path(__file__).resolve().parent / "fixture-notes" / f"{tool}.md")
    lines = [
        f"# {tool} conformance fixtures",
        "",
        "Written by the real producer tool and read back by its own reader; regenerate with",
        f"`python3 scripts/make-fixtures.py {tool}` (not run in CI). `manifest.json` holds the",
        "size and sha256 of every file here; `tests/unit/formats/test_fixtures_corpus.py` checks them.",
        "",
        "## Versions",
        "",
        *[f"- {k}: `{v}`" for k, v in meta["versions"].items()],
        "",
        "## How it was made",
        "",
        "Virtualenv and install commands:",
        "",
        "```",
        *[c.replace(str(REPO) + "/", "") for c in log],
        "```",
        "",
        f"Producer calls (code: `scripts/make-fixtures.py`, `make_{tool}`):",
        "",
        "```",
        *meta["code"],
        "```",
        "",
        "Values in `expected.json` that JSON cannot hold are tagged: `{\"$bytes\": base64}`,",
        "`{\"$npy\": base64 of numpy.save bytes}`, `{\"$float\": \"nan\"}`.",
        "",
    ]
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    (dest / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
