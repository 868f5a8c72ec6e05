"""Shard index ``N`` across the shardsets (:class:`LavenderShard`, the folder ``shard.NNNNN``):
the join by uid of its files' rows, made once by :meth:`LavenderShard.prepare` and kept as
a saved state (:mod:`atlasfs.formats.state`) that :meth:`LavenderShard.restore` takes back,
checked as untrusted input; then blocks of samples read from only their rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from atlasfs.formats import state
from atlasfs.formats.lavender import cells
from atlasfs.formats.lavender.errors import Problems, TooLarge
from atlasfs.formats.lavender.files import LavenderError, ShardFile, uid_text
from atlasfs.formats.lavender.join import BLOCK_ROWS, block_rows, join, key_width, unsafe_uids
from atlasfs.formats.naming import INDEX_KEY_MIN_WIDTH
from atlasfs.formats.source import SourceShard
from atlasfs.storage import StorageUnavailableError

if TYPE_CHECKING:
    from atlasfs.formats.lavender.source import LavenderSource

#: Version of what :meth:`LavenderShard.prepare` returns (:mod:`.state`); a stored state of another is not restored.
STATE_VERSION = 3


class LavenderShard(SourceShard):
    """Shard index ``index`` across the shardsets: the folder ``shard.NNNNN``."""

    def __init__(self, source: LavenderSource, index: int, files: dict[str, ShardFile]) -> None:
        self.source = source
        self.storage = source.storage
        self.index = index
        self.files = files  # shardset name -> its file of this index, in shardset order
        self.name = f"shard.{index:05d}"
        self.path = f"{source.root}/*/{self.name}"
        self.uid = source.uid
        self.first_index = 0  # each shard numbers its samples from 0 (index keys only where a uid cannot be a key)
        self.mtime = 0.0
        self.data_size = 0
        for file in files.values():
            try:
                found = source.storage.stat(file.path)
            except StorageUnavailableError:
                raise
            except OSError:
                found = None
            if found is None:
                continue
            self.mtime = max(self.mtime, found[1] / 1e9)
            self.data_size += found[0]
        self._ready = False
        self._num_samples = 0
        self._block_rows = BLOCK_ROWS
        self._width = INDEX_KEY_MIN_WIDTH
        self._used: list[str] = []  # shardsets joined, in order (files left out are not)
        self._rows: dict[str, np.ndarray] = {}  # shardset -> row of each sample in its file, -1: none
        self._names: dict[str, dict[str, str]] = {}  # shardset -> column -> field name (renamed clashes)
        self._plans: dict[str, list[tuple[int, str, str | None]]] = {}  # shardset -> (position, field, cell kind)
        self._problems: list[str] = []
        self._unsafe: frozenset[int] = frozenset()  # samples whose uid cannot be a key
        self._partial: dict[str, list[str]] = {}  # shardset -> uids it has that another shardset lacks here

    # -- the pass over its files

    def prepare(self) -> bytes:
        """Read the uid column of every file of the shard, join them, note what breaks the
        rules; returns all that (and where csv rows start) for :meth:`restore`."""
        problems: list[str] = []
        uids_of: dict[str, list[str | None]] = {}
        offsets: dict[str, np.ndarray] = {}
        for name, file in self.files.items():
            try:
                scan = file.scan(self.uid)
            except LavenderError as exc:
                problems.append(str(exc))  # the file is left out; the other shardsets serve
                continue
            uids_of[name] = scan.uids
            problems.extend(scan.problems)
            if scan.offsets is not None:
                offsets[name] = scan.offsets
        main = self.source.main
        if main not in uids_of:
            self._problems = problems
            raise LavenderError(f"{self.path}: the file of its main shardset {main!r} cannot be read "
                                f"({problems[0] if problems else ''})")
        paths = {name: file.path for name, file in self.files.items()}
        joined = Problems()
        order, arrays, partial = join(main, uids_of, paths, self.source.join, joined)
        problems.extend(joined.lines())
        count = len(order)
        groups = self.files[main].row_groups()
        fields: dict[str, state.Value] = {
            "uid": self.uid, "main": main, "join": self.source.join, "count": count, "used": list(arrays),
            "block_rows": block_rows(groups), "width": key_width(order), "problems": problems,
            "unsafe": np.array(unsafe_uids(order), dtype="<i8"),
            **{f"rows:{name}": array.astype("<i8") for name, array in arrays.items()},
            **{f"offsets:{name}": array.astype("<i8") for name, array in offsets.items() if name in arrays},
            **{f"partial:{name}": uids for name, uids in partial.items()}}
        saved = state.encode("lavender", STATE_VERSION, fields)
        self.restore(saved)
        return saved

    def restore(self, saved: bytes) -> None:
        """Take back what :meth:`prepare` returned; ``ValueError`` if it does not fit this shard."""
        fields = state.decode(saved, "lavender", STATE_VERSION)
        fields.only({"uid", "main", "join", "count", "used", "block_rows", "width", "problems", "unsafe"},
                    ("rows:", "offsets:", "partial:"))
        if fields.text("uid", one_line=False, max_len=1 << 16) != self.uid:
            raise state.StateError("the state is for another uid column")
        if fields.text("main", one_line=False, max_len=1 << 16) != self.source.main:
            raise state.StateError("the state is for another main shardset")
        if fields.text("join") != self.source.join:
            raise state.StateError("the state is for another join")
        count = fields.integer("count")
        used = fields.texts("used", max_count=len(self.files), one_line=False)
        if (any(name not in self.files for name in used) or len(set(used)) != len(used)
                or not used or used[0] != self.source.main):
            raise state.StateError("the state's shardsets are not this shard's")
        rows = {name: fields.array(f"rows:{name}", "<i8", (count,)) for name in used}
        for name in used:
            file = self.files[name]
            if file.kind == "csv":
                offsets = self._checked_offsets(fields, name)
                if len(rows[name]) and int(rows[name].max()) >= len(offsets) - 1:
                    raise state.StateError(f"rows of {name} past the rows of {file.path}")
                file.set_offsets(offsets)
            if len(rows[name]) and int(rows[name].min()) < -1:
                raise state.StateError(f"rows of {name} are not row numbers")
        unsafe = fields.array("unsafe", "<i8")
        if len(unsafe) and (int(unsafe.min()) < 0 or int(unsafe.max()) >= count):
            raise state.StateError("unsafe uids that are not samples of the shard")
        self._used = used
        self._num_samples = count
        self._rows = rows
        self._unsafe = frozenset(unsafe.tolist())
        self._block_rows = fields.integer("block_rows", 1)
        self._width = fields.integer("width", 1, 1 << 16)
        self._problems = fields.texts("problems", max_len=1 << 20, one_line=False)
        self._partial = {name[len("partial:"):]: fields.texts(name, max_len=1 << 20, one_line=False)
                         for name in fields.names("partial:")}
        try:
            self._names = self._field_names()
            self._plans = self._plan()
        except LavenderError as exc:  # a file unreadable now: prepare() will say so
            raise ValueError(str(exc)) from None
        self._ready = True
        self.source._opened(self)

    def _checked_offsets(self, fields: state.State, name: str) -> np.ndarray:
        """Where the csv rows of ``name``'s file start, as stored: in order and within the file."""
        offsets = fields.array(f"offsets:{name}", "<i8")
        path = self.files[name].path
        found = self.storage.stat(path)
        if found is None:
            raise state.StateError(f"{path}: cannot be read (no such file)")
        size = found[0]
        if len(offsets) == 0 or int(offsets[0]) < 0 or int(offsets[-1]) > size or np.any(np.diff(offsets) < 0):
            raise state.StateError(f"stored row offsets of {path} are out of order or past its end")
        return offsets

    def _field_names(self) -> dict[str, dict[str, str]]:
        """Each used shardset's columns and the field names they get: the column's own, or
        ``<shardset>.<column>`` for a name (case folded) two shardsets have."""
        columns = {name: [c for c in self.files[name].columns() if c != self.uid] for name in self._used}
        seen: dict[str, list[str]] = {}
        for name, names in columns.items():
            for column in names:
                seen.setdefault(column.casefold(), []).append(name)
        clashing = {folded for folded, sets in seen.items() if len(sets) > 1}
        fields = {}
        for name, names in columns.items():
            fields[name] = {c: (f"{name}.{c}" if c.casefold() in clashing else c) for c in names}
            for column in names:
                if column.casefold() in clashing:
                    self.source._log_once(f"{self.source.root}: column {column!r} is in shardsets "
                                          f"{', '.join(seen[column.casefold()])}: shown as <shardset>.{column}")
        return fields

    def _plan(self) -> dict[str, list[tuple[int, str, str | None]]]:
        """Per used shardset, the columns shown: (position in its rows, field name, cell kind).
        A binary column's field ends in the extension of its kind (``tokens.npy``,
        ``image_png.png``); the uid column and a ``__key__`` column are not shown."""
        kinds = self.source.kinds()
        plans = {}
        for name in self._used:
            named = self._names[name]
            plans[name] = [(i, cells.field_name(named[c], kinds.get((name, c))), kinds.get((name, c)))
                           for i, c in enumerate(self.files[name].columns())
                           if c != self.uid and named[c] != "__key__"]
        return plans

    # -- blocks

    @property
    def num_samples(self) -> int:
        """Samples in the shard (once prepared or restored)."""
        return self._num_samples

    @property
    def block_size(self) -> int:
        return self._block_rows

    @property
    def num_blocks(self) -> int:
        return -(-self._num_samples // self._block_rows)

    def block_length(self, block: int) -> int:
        return max(0, min(self._block_rows, self._num_samples - block * self._block_rows))

    @property
    def key_width(self) -> int:
        return self._width

    def block_where(self, block: int) -> str:
        first = block * self._block_rows
        return f"{self.path} samples {first}..{first + self.block_length(block) - 1}"

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The block's samples: ``{"__key__": uid, "<column>": value, ...}`` joined from every
        shardset that has the uid."""
        if not self._ready:
            raise LavenderError(f"{self.path}: read before it was prepared")
        first = block * self._block_rows
        last = first + self.block_length(block)
        samples: list[dict[str, Any] | None] = [None] * (last - first)
        held = 150 * (last - first)
        taken = 0  # bytes of rows read, every shardset's: a block's files may not take more than max_block_bytes
        for name in self._used:
            file = self.files[name]
            wanted = self._rows[name][first:last]
            try:
                records, read = file.read_rows(wanted[wanted >= 0], self.source.row_groups, self.max_block_bytes - taken)
            except TooLarge as exc:
                raise LavenderError(f"{self.block_where(block)}: its rows take more than the block bound of "
                                    f"{self.max_block_bytes} bytes ({exc}); not read") from None
            taken += read
            held += 2 * read
            key_at = file.columns().index(self.uid)
            plan = self._plans[name]
            for pos, row in enumerate(wanted.tolist()):
                if row < 0:
                    continue  # join=left: a uid this shardset lacks has none of its columns
                record = records.get(row)
                if record is None:
                    raise LavenderError(f"{file.path} row {row + 1}: cannot be read (the file changed?)")
                sample = samples[pos]
                if sample is None:
                    uid = record[key_at]
                    sample = samples[pos] = {"__key__": uid if type(uid) is str else uid_text(uid)}
                    if first + pos in self._unsafe:
                        sample[self.uid] = uid  # it will get an index key: keep the uid as a file
                for at, field, kind in plan:
                    value = record[at]
                    if value is None:
                        continue  # a parquet null is no file
                    if kind is not None:
                        if not value:
                            continue  # an empty cell of a binary column: lavender-data's own null (b"")
                        try:
                            value = cells.cell_bytes(kind, value)
                        except ValueError as exc:
                            raise LavenderError(f"{file.path} row {row + 1}: column {file.columns()[at]!r} {exc} "
                                                f"(its files are <uid>.{field}, from its first cell)") from None
                    sample[field] = value
        return samples, held

    # -- what a stored table depends on

    def table_files(self) -> list[str]:
        return [file.path for file in self.files.values()]

    def table_key(self) -> dict[str, Any]:
        """The files' signatures, what joins them (the uid column, the main shardset, the join:
        others give other samples), the kind of each binary column (its files' extension) and
        the state's version."""
        kinds = self.source.kinds()
        return {**super().table_key(), "uid": self.uid, "main": self.source.main, "join": self.source.join,
                "kinds": {f"{n}/{c}": k for (n, c), k in sorted(kinds.items()) if n in self.files},
                "lavender": STATE_VERSION}

    def problems(self) -> list[str]:
        """What the pass over the shard's files found wrong, one line each."""
        return list(self._problems)

    def close(self) -> None:
        for file in self.files.values():
            file.close()

