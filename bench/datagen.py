"""The benchmark's data: three synthetic datasets, each in three forms holding the same files.

* ``atlas/``: the Atlas dataset, written with :class:`atlasfs.AtlasWriter` (strategy 2).
* ``tars/``: ``atlasfs export`` of it, one WebDataset tar per shard (``<shard>.tar``).
* a materialized folder (``<shard>/<files>``) extracted from those tars with GNU tar, on tmpfs.

Everything is deterministic: the same sizes give byte-identical files on every run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from atlasfs import AtlasWriter
from bench import harness

#: Bump when the generators change, so that cached data sets are rebuilt.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class DatasetSpec:
    """One synthetic dataset: what it is like and how it is laid out in Atlas."""

    name: str
    description: str
    examples: int
    shard_size: int
    block_size: int
    seed: int


#: Default sizes: the whole default run takes a few minutes on 2 cores (docs/performance.md).
DEFAULTS: dict[str, DatasetSpec] = {
    "image": DatasetSpec("image", "~100 KiB incompressible jpg + cls int + small json dict",
                         examples=1500, shard_size=250, block_size=8, seed=1),
    "text": DatasetSpec("text", "2-8 KiB English-like txt + json metadata (compressible)",
                        examples=8000, shard_size=2000, block_size=64, seed=2),
    "tiny": DatasetSpec("tiny", "three ~1 KiB fields (bin, txt, json) per example: many small files",
                        examples=8000, shard_size=2000, block_size=128, seed=3),
}

#: Sizes of ``--smoke``: seconds, not minutes; still several shards and blocks each.
SMOKE_EXAMPLES = {"image": 60, "text": 400, "tiny": 600}
SMOKE_SHARDS = {"image": 20, "text": 100, "tiny": 150}
SMOKE_BLOCKS = {"image": 2, "text": 8, "tiny": 16}  # >= 7 blocks a shard, so strategy 2 trains its dictionary


def spec_for(name: str, examples: int | None = None, smoke: bool = False) -> DatasetSpec:
    """The spec of dataset ``name`` with ``examples`` examples (default: its default, or the smoke size)."""
    base = DEFAULTS[name]
    if smoke:
        base = DatasetSpec(base.name, base.description, SMOKE_EXAMPLES[name], SMOKE_SHARDS[name],
                           SMOKE_BLOCKS[name], base.seed)
    if examples is not None:
        if examples < 1:
            raise ValueError(f"{name}: the number of examples must be >= 1")
        base = DatasetSpec(base.name, base.description, examples, base.shard_size, base.block_size, base.seed)
    return base


# -- English-like text

_WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "i", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may", "these", "two", "about", "than", "into", "them", "only", "some", "time", "could", "new", "them", "first", "also", "any", "after", "such", "like", "our", "what", "over", "most", "made", "between", "years", "many", "before", "must", "through", "back", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "both", "between", "under", "never", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three", "himself", "few", "house", "use", "during", "without", "again", "place", "around", "however", "home", "small", "found", "thought", "went", "say", "part", "once", "general", "high", "upon", "school", "every", "does", "got", "united", "left", "number", "course", "war", "until", "always", "away", "something", "fact", "water", "though", "less", "public", "put", "think", "almost", "hand", "enough", "far", "took", "head", "yet", "government", "system", "better", "set", "told", "nothing", "night", "end", "why", "called", "did", "eyes", "find", "going", "look", "asked", "later", "knew", "point", "next", "program", "city", "business", "give", "group", "toward", "young", "days", "let", "room", "president", "side", "social", "given", "present", "several", "order", "national", "possible", "rather", "second", "face", "per", "among", "form", "important", "often", "things", "looked", "early", "white", "john", "case", "become", "large", "big", "need", "four", "within", "felt", "along", "children", "saw", "best", "church", "ever", "least", "power", "development", "light", "thing", "seemed", "family", "interest", "want", "members", "mind", "country", "area", "others", "done", "turned", "although", "open", "god", "service", "problem", "certain", "kind", "different", "thus", "began", "door", "help", "means", "sense", "whole", "matter", "perhaps", "itself", "york", "times", "law", "human", "line", "above", "name", "example", "action", "company", "hands", "local", "show", "whether", "five", "history", "gave", "today", "either", "act", "feet", "across", "taken", "past", "quite", "anything", "seen", "having", "death", "experience", "body", "word", "half", "really", "field", "am", "car", "words", "already", "themselves", "information", "tell", "together", "college", "shall", "money", "period", "held", "keep", "sure", "probably", "free", "seems", "political", "real", "behind", "cannot", "miss", "question", "air", "office", "making", "brought", "whose", "special", "heard", "major", "problems", "ago", "became", "federal", "moment", "study", "available", "known", "result", "street", "economic", "boy", "reason", "change", "position", "south", "board", "individual", "job", "society", "areas", "west", "close", "turn", "love", "community", "true", "court", "force", "full", "seem", "am", "front", "process", "art", "market", "model", "data", "training", "dataset", "image", "learning", "network", "layer"]


_SYLLABLES = ["ka", "ri", "to", "ne", "ma", "sa", "lo", "ve", "di", "pu", "ro", "te", "an", "el", "in", "or", "un", "ba", "ce", "fi", "go", "hu", "ja", "ke", "li", "mo", "nu", "pe", "qua", "ra", "se", "ti", "vo", "wa", "xe", "yo", "za", "ber", "con", "dis", "for", "gra", "ment", "tion", "ing", "ous", "ly", "pre", "pro", "str", "tra", "ver"]


class TextSource:
    """English-like text: words drawn with Zipf frequencies from the most common English words
    followed by a long tail of made-up words, in sentences of 6 to 21 words. zstd compresses it
    about as well as real English prose (roughly 3x)."""

    def __init__(self, rng: np.random.Generator, vocabulary: int = 20000) -> None:
        words = list(dict.fromkeys(_WORDS))
        while len(words) < vocabulary:
            parts = rng.integers(0, len(_SYLLABLES), size=int(rng.integers(2, 5)))
            words.append("".join(_SYLLABLES[i] for i in parts))
        self.words = words
        ranks = np.arange(1, len(words) + 1, dtype=np.float64)
        p = 1.0 / ranks ** 1.05
        self.cdf = np.cumsum(p / p.sum())
        self.rng = rng

    def text(self, min_bytes: int, max_bytes: int) -> str:
        """A paragraph of ``min_bytes``..``max_bytes`` ASCII bytes (uniformly drawn)."""
        target = int(self.rng.integers(min_bytes, max_bytes + 1))
        picks = np.searchsorted(self.cdf, self.rng.random(target // 4 + 16))
        words = [self.words[i] for i in picks]
        end = 0
        for length in self.rng.integers(6, 22, size=len(words) // 6 + 1):
            if end >= len(words):
                break
            words[end] = words[end].capitalize()
            end = min(end + int(length), len(words))
            words[end - 1] += "."
        text = " ".join(words)
        while len(text) < target:  # rare: many short words
            text += " " + text
        return text[:target]


# -- the three generators


def image_examples(spec: DatasetSpec) -> Iterator[dict[str, Any]]:
    """~100 KiB of incompressible bytes as ``jpg`` (with a JPEG header), a ``cls`` int, a small ``json`` dict."""
    rng = np.random.default_rng(spec.seed)
    for i in range(spec.examples):
        size = int(rng.integers(80 << 10, 120 << 10))
        jpg = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + rng.bytes(size - 11)
        yield {
            "jpg": jpg,
            "cls": int(rng.integers(0, 1000)),
            "json": {"width": int(rng.integers(200, 1024)), "height": int(rng.integers(200, 1024)),
                     "source": f"camera{int(rng.integers(0, 50))}", "id": i},
        }


def text_examples(spec: DatasetSpec) -> Iterator[dict[str, Any]]:
    """2-8 KiB of English-like ``txt`` and a ``json`` metadata dict."""
    rng = np.random.default_rng(spec.seed)
    source = TextSource(rng)
    domains = ["example.org", "news.example.com", "blog.example.net", "wiki.example.org", "forum.example.io"]
    for i in range(spec.examples):
        text = source.text(2 << 10, 8 << 10)
        yield {
            "txt": text,
            "json": {"url": f"https://{domains[int(rng.integers(0, len(domains)))]}/page/{i}",
                     "language": "en", "quality": round(float(rng.random()), 4), "chars": len(text),
                     "tokens": len(text) // 4},
        }


def tiny_examples(spec: DatasetSpec) -> Iterator[dict[str, Any]]:
    """Three ~1 KiB fields: random ``bin`` bytes, English-like ``txt``, a ``json`` list of numbers."""
    rng = np.random.default_rng(spec.seed)
    source = TextSource(rng)
    for i in range(spec.examples):
        values = [round(float(v), 3) for v in rng.random(120)]
        yield {"bin": rng.bytes(1024), "txt": source.text(900, 1100), "json": {"id": i, "values": values}}


GENERATORS: dict[str, Callable[[DatasetSpec], Iterator[dict[str, Any]]]] = {
    "image": image_examples, "text": text_examples, "tiny": tiny_examples,
}


# -- building the three forms


@dataclass
class Prepared:
    """Where a dataset's three forms are, and what is in them."""

    spec: DatasetSpec
    atlas: str
    tars: str
    files: int
    file_bytes: int
    shards: list[str]
    atlas_bytes: int
    tar_bytes: int
    generate_seconds: float
    reused: bool


def _atlasfs_command() -> list[str]:
    return [sys.executable, "-m", "atlasfs"]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def prepare(spec: DatasetSpec, workdir: str, log: Callable[[str], None]) -> Prepared:
    """Write ``spec``'s Atlas dataset and its exported tars under ``workdir/<name>`` (reused when they
    were made from the same spec by the same generator version)."""
    root = os.path.join(workdir, spec.name)
    atlas = os.path.join(root, "atlas")
    tars = os.path.join(root, "tars")
    stamp_path = os.path.join(root, "done.json")
    stamp = {"generator": GENERATOR_VERSION, "spec": asdict(spec)}
    done = harness.kept(stamp_path, stamp)
    if done is not None:
        return Prepared(spec, atlas, tars, done["files"], done["file_bytes"], done["shards"],
                            done["atlas_bytes"], done["tar_bytes"], done["generate_seconds"], True)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    start = time.perf_counter()
    log(f"{spec.name}: writing {spec.examples} examples as Atlas (shards of {spec.shard_size}, "
        f"blocks of {spec.block_size}, strategy 2)")
    with AtlasWriter(atlas, shard_size=spec.shard_size, block_size=spec.block_size,
                     compression_strategy=2) as writer:
        writer.add_examples(GENERATORS[spec.name](spec))
    log(f"{spec.name}: exporting WebDataset tars with atlasfs export")
    result = subprocess.run([*_atlasfs_command(), "export", atlas, tars], capture_output=True, check=False, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs export {atlas} failed: {result.stderr.strip()}")
    shards = sorted(f[:-4] for f in os.listdir(tars) if f.endswith(".tar"))
    files = 0
    file_bytes = 0
    for shard in shards:
        with tarfile.open(os.path.join(tars, f"{shard}.tar")) as archive:
            for member in archive:
                if member.isfile():
                    files += 1
                    file_bytes += member.size
    prepared = Prepared(spec, atlas, tars, files, file_bytes, shards, _dir_bytes(atlas), _dir_bytes(tars),
                        time.perf_counter() - start, False)
    harness.keep(stamp_path, stamp, files=files, file_bytes=file_bytes, shards=shards,
                 atlas_bytes=prepared.atlas_bytes, tar_bytes=prepared.tar_bytes,
                 generate_seconds=prepared.generate_seconds)
    return prepared


def materialize(prepared: Prepared, folder: str) -> None:
    """Extract every shard tar into ``folder/<shard>/`` with GNU tar (``folder`` is on tmpfs)."""
    shutil.rmtree(folder, ignore_errors=True)
    for shard in prepared.shards:
        target = os.path.join(folder, shard)
        os.makedirs(target)
        subprocess.run(["tar", "xf", os.path.join(prepared.tars, f"{shard}.tar"), "-C", target], check=True)


def file_list(folder: str) -> list[str]:
    """Every file below ``folder``, as sorted paths relative to it."""
    out = []
    for d, _, fs in os.walk(folder):
        rel = os.path.relpath(d, folder)
        out.extend(os.path.normpath(os.path.join(rel, f)) for f in fs)
    return sorted(out)
