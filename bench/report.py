"""Figures, their statistics, the targets, and the Markdown and JSON reports."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

SYSTEMS = ("atlasfs", "tmpfs", "ratarmount")
MOUNTED = ("atlasfs", "ratarmount")


@dataclass(frozen=True)
class Figure:
    """One measured quantity: how it is named, its unit, and which way is better."""

    id: str
    label: str
    unit: str
    higher_is_better: bool
    systems: tuple[str, ...] = SYSTEMS
    table: str = "throughput"  # throughput | times | memory | inprocess


FIGURES: list[Figure] = [
    Figure("tar_cold_mbps", "tar of every shard, cold (fresh mount)", "MB/s", True),
    Figure("tar_cold_fps", "tar of every shard, cold (fresh mount)", "files/s", True),
    Figure("tar_warm_mbps", "tar of every shard, warm (2nd pass, same mount)", "MB/s", True),
    Figure("tar_warm_fps", "tar of every shard, warm (2nd pass, same mount)", "files/s", True),
    Figure("tar_first_mbps", "tar of every shard, first mount ever (nothing stored)", "MB/s", True),
    Figure("tar_first_fps", "tar of every shard, first mount ever (nothing stored)", "files/s", True),
    Figure("cat_cold_fps", "random reads, cold (fresh mount)", "files/s", True),
    Figure("cat_warm_fps", "random reads, warm (same files again)", "files/s", True),
    Figure("par1_fps", "parallel random reads, cold, 1 reader process (`xargs cat`)", "files/s", True),
    Figure("par4_fps", "parallel random reads, cold, 4 reader processes at once (`xargs cat`)", "files/s", True),
    Figure("mount_s", "mount (tables / index stored)", "s", False, MOUNTED, "times"),
    Figure("mount_first_s", "mount, first ever (nothing stored)", "s", False, MOUNTED, "times"),
    Figure("ls_first_s", "first `ls` of a shard after mount (tables / index stored)", "s", False, table="times"),
    Figure("ls_first_nostore_s", "first `ls` of a shard after a first-ever mount", "s", False, table="times"),
    Figure("cat_cold_p50_ms", "random read latency, cold, p50", "ms", False, table="times"),
    Figure("cat_cold_p99_ms", "random read latency, cold, p99", "ms", False, table="times"),
    Figure("cat_warm_p50_ms", "random read latency, warm, p50", "ms", False, table="times"),
    Figure("cat_warm_p99_ms", "random read latency, warm, p99", "ms", False, table="times"),
    Figure("find_cold_s", "`find -type f | wc -l`, cold", "s", False, table="times"),
    Figure("find_warm_s", "`find -type f | wc -l`, warm", "s", False, table="times"),
    Figure("lsR_cold_s", "`ls -lR`, cold", "s", False, table="times"),
    Figure("lsR_warm_s", "`ls -lR`, warm", "s", False, table="times"),
    Figure("du_cold_s", "`du -sb`, cold", "s", False, table="times"),
    Figure("du_warm_s", "`du -sb`, warm", "s", False, table="times"),
    Figure("rss_mib", "daemon peak RSS (VmHWM), max over a repeat's mounts", "MiB", False, MOUNTED, "memory"),
    Figure("export_mbps", "`atlasfs export` of every shard (tars to tmpfs)", "MB/s", True, ("atlasfs",), "inprocess"),
    Figure("export_fps", "`atlasfs export` of every shard (tars to tmpfs)", "files/s", True, ("atlasfs",), "inprocess"),
    Figure("startup_s", "`atlasfs --version`: start-up that every command, export included, pays", "s", False,
           ("atlasfs",), "inprocess"),
    Figure("loop_eps", "Python loop over `AtlasDataset`, decoding every example", "examples/s", True,
           ("atlasfs",), "inprocess"),
    Figure("loop_mbps", "Python loop over `AtlasDataset` (file bytes equivalent)", "MB/s", True,
           ("atlasfs",), "inprocess"),
    Figure("decode_shard_s", "decode of every block of shard 0, in process", "s", False, ("atlasfs",), "inprocess"),
]
FIGURE_BY_ID = {f.id: f for f in FIGURES}


@dataclass
class Results:
    """Samples of every figure of one dataset, per system, and why any are missing."""

    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    missing: dict[str, dict[str, str]] = field(default_factory=dict)
    answers: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    def add(self, figure: str, system: str, value: float) -> None:
        assert figure in FIGURE_BY_ID, figure
        self.samples.setdefault(figure, {}).setdefault(system, []).append(value)

    def fail(self, figure: str, system: str, reason: str) -> None:
        self.missing.setdefault(figure, {}).setdefault(system, reason)

    def answer(self, what: str, system: str, value: Any) -> None:
        """Record what a command answered (file counts, tar bytes, checksums) for cross-checks."""
        self.answers.setdefault(what, {}).setdefault(system, []).append(value)

    def stats(self, figure: str, system: str) -> dict[str, Any]:
        """``{"median", "min", "max", "samples"}``, or ``{"missing": reason}``."""
        values = self.samples.get(figure, {}).get(system)
        reason = self.missing.get(figure, {}).get(system)
        if reason is not None or not values:
            return {"missing": reason or "not measured"}
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}

    def median(self, figure: str, system: str) -> float | None:
        return self.stats(figure, system).get("median")

    def mismatches(self) -> list[str]:
        """Answers that differ between systems or between passes (the same files must give the same answers)."""
        problems = []
        for what, by_system in sorted(self.answers.items()):
            distinct = {repr(v) for values in by_system.values() for v in values}
            if len(distinct) > 1:
                shown = "; ".join(f"{s}: {sorted({repr(v) for v in vs})}" for s, vs in by_system.items())
                problems.append(f"{what} differs: {shown}")
        return problems


def ratio(results: Results, figure: str, other: str) -> float | None:
    """atlasfs's median divided by ``other``'s (None if either is missing or zero)."""
    a, b = results.median(figure, "atlasfs"), results.median(figure, other)
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- targets


@dataclass
class Target:
    """One target of the issue, evaluated on one dataset."""

    dataset: str
    text: str
    measured: float | None
    threshold: float
    at_least: bool
    low: float | None = None
    high: float | None = None
    note: str = ""
    unit: str = ""  # "" for a ratio

    @property
    def is_ratio(self) -> bool:
        return not self.unit

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.threshold if self.at_least else self.measured <= self.threshold

    @property
    def borderline(self) -> bool:
        """The min-max range of the runs straddles the threshold."""
        if self.low is None or self.high is None:
            return False
        return self.low < self.threshold < self.high

    def as_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "target": self.text, "measured": self.measured,
                "threshold": self.threshold, "direction": ">=" if self.at_least else "<=",
                "unit": self.unit or "ratio", "range": [self.low, self.high], "met": self.met, "borderline": self.borderline, "note": self.note}


def _range_ratio(results: Results, num: tuple[str, str], den: tuple[str, str]) -> tuple[float | None, float | None]:
    """Worst and best ratio over the runs' min-max ranges (a rough noise band)."""
    a, b = results.stats(*num), results.stats(*den)
    if "median" not in a or "median" not in b or not b["min"] or not b["max"]:
        return None, None
    return a["min"] / b["max"], a["max"] / b["min"]


def _ratio_target(ds: str, results: Results, text: str, num: tuple[str, str], den: tuple[str, str],
                  threshold: float, note: str = "") -> Target:
    a, b = results.median(*num), results.median(*den)
    measured = a / b if a is not None and b else None
    low, high = _range_ratio(results, num, den)
    return Target(ds, text, measured, threshold, True, low, high, note)


def evaluate_targets(all_results: dict[str, Results], cache_bound_mib: float) -> list[Target]:
    """The issue's targets, on every dataset they apply to."""
    targets: list[Target] = []
    for ds, r in all_results.items():
        # issue #17's targets (libfuse 3); the FUSE floor they are also held to is bench/floor.py's
        if ds == "image":
            targets.append(_ratio_target(ds, r, "cold tar MB/s >= 0.33 of tmpfs (100 KB files)",
                                         ("tar_cold_mbps", "atlasfs"), ("tar_cold_mbps", "tmpfs"), 0.33))
        if ds == "tiny":
            targets.append(_ratio_target(ds, r, "cold tar files/s >= 0.20 of tmpfs (1 KiB files)",
                                         ("tar_cold_fps", "atlasfs"), ("tar_cold_fps", "tmpfs"), 0.20))
        targets.append(_ratio_target(ds, r, "warm tar >= 0.9 of tmpfs", ("tar_warm_mbps", "atlasfs"),
                                     ("tar_warm_mbps", "tmpfs"), 0.9))
        targets.append(_ratio_target(ds, r, "cold tar >= 3x ratarmount", ("tar_cold_mbps", "atlasfs"),
                                     ("tar_cold_mbps", "ratarmount"), 3.0))
        targets.append(_ratio_target(ds, r, "random reads, cold, files/s >= 2x ratarmount",
                                     ("cat_cold_fps", "atlasfs"), ("cat_cold_fps", "ratarmount"), 2.0))
        p99 = r.median("cat_cold_p99_ms", "atlasfs"), r.median("cat_cold_p99_ms", "ratarmount")
        targets.append(Target(ds, "random reads, cold, p99 latency <= ratarmount's", None if None in p99 else p99[0] / p99[1],
                              1.0, False, *_range_ratio(r, ("cat_cold_p99_ms", "atlasfs"), ("cat_cold_p99_ms", "ratarmount"))))
        # issue #27's parallel readers (image-like and tiny sets)
        if ds in ("image", "tiny"):
            targets.append(_ratio_target(ds, r, "4 readers: files/s >= 2x ratarmount's 4 readers",
                                         ("par4_fps", "atlasfs"), ("par4_fps", "ratarmount"), 2.0))
            targets.append(_ratio_target(ds, r, "4 readers: files/s >= 1.6x atlasfs's 1 reader",
                                         ("par4_fps", "atlasfs"), ("par1_fps", "atlasfs"), 1.6))
        targets.append(_ratio_target(ds, r, "random reads, warm, files/s >= 2x ratarmount",
                                     ("cat_warm_fps", "atlasfs"), ("cat_warm_fps", "ratarmount"), 2.0))
        if ds == "image":
            targets.append(_ratio_target(ds, r, "cold tar through the mount >= 50% of atlasfs export (MB/s)",
                                         ("tar_cold_mbps", "atlasfs"), ("export_mbps", "atlasfs"), 0.5,
                                         "export timed as a command, Python start-up included"))
        for fig, what in (("mount_s", "mount returns in < 1 s (tables stored)"),
                          ("mount_first_s", "mount returns in < 1 s (first mount ever)")):
            s = r.stats(fig, "atlasfs")
            targets.append(Target(ds, what, s.get("median"), 1.0, False, s.get("min"), s.get("max"), unit="s"))
        decode = r.stats("decode_shard_s", "atlasfs")
        for fig, what in (("ls_first_nostore_s", "first listing of a shard <= 1.5x one decode of it (nothing stored)"),
                          ("ls_first_s", "first listing of a shard <= 1.5x one decode of it (tables stored)")):
            s = r.stats(fig, "atlasfs")
            if "median" in s and "median" in decode and decode["median"]:
                targets.append(Target(ds, what, s["median"] / decode["median"], 1.5, False,
                                      s["min"] / decode["max"], s["max"] / decode["min"],
                                      "ratio of times; the listing is an `ls` subprocess (~1-2 ms of fork/exec)"))
            else:
                targets.append(Target(ds, what, None, 1.5, False))
        s = r.stats("rss_mib", "atlasfs")
        targets.append(Target(ds, f"daemon peak RSS <= cache bound + 100 MiB ({cache_bound_mib + 100:.0f} MiB)",
                              s.get("median"), cache_bound_mib + 100, False, s.get("min"), s.get("max"), unit="MiB"))
    return targets


# -- formatting


def fmt(value: float | None) -> str:
    """A number with about three significant digits, thousands separated."""
    if value is None:
        return "missing"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    if a == 0:
        return "0"
    return f"{value:.2g}" if a < 0.01 else f"{value:.3f}"


def cell(stats: dict[str, Any]) -> str:
    """``median (min–max)``, or why it is missing."""
    if "median" not in stats:
        return "missing"  # the reasons are listed under the tables
    if len(stats["samples"]) == 1:
        return fmt(stats["median"])
    return f"{fmt(stats['median'])} ({fmt(stats['min'])}–{fmt(stats['max'])})"


def fmt_ratio(value: float | None) -> str:
    """A ratio with two decimals, three below 0.1."""
    if value is None:
        return "missing"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _ratio_cell(value: float | None, applicable: bool) -> str:
    return fmt_ratio(value) if applicable else "n/a"


def _md(text: str) -> str:
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|")


def dataset_tables(name: str, info: dict[str, Any], results: Results, unavailable: dict[str, str]) -> list[str]:
    """The Markdown section of one dataset."""
    lines = [f"### {name}: {info['description']}", ""]
    lines.append(f"{info['examples']:,} examples, {info['files']:,} files, {info['file_bytes'] / 1e6:.1f} MB of "
                 f"files; Atlas {info['atlas_bytes'] / 1e6:.1f} MB in {info['shards']} shards of "
                 f"{info['shard_size']:,} examples, blocks of {info['block_size']} (strategy 2); "
                 f"WebDataset tars {info['tar_bytes'] / 1e6:.1f} MB.")
    lines.append("")
    titles = {"throughput": "Throughput: higher is better, and so are the ratios",
              "times": "Times and latencies: lower is better, and so are the ratios",
              "memory": "Memory: lower is better"}
    for table, title in titles.items():
        figures = [f for f in FIGURES if f.table == table]
        direction = "higher is better" if table == "throughput" else "lower is better"
        lines += [f"**{title}**", "",
                  f"| workload | unit | atlasfs | tmpfs | ratarmount | atlasfs ÷ tmpfs ({direction}) "
                  f"| atlasfs ÷ ratarmount ({direction}) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for f in figures:
            row = [_md(f.label), f.unit]
            for system in SYSTEMS:
                row.append(cell(results.stats(f.id, system)) if system in f.systems else "n/a")
            for other in ("tmpfs", "ratarmount"):
                row.append(_ratio_cell(ratio(results, f.id, other), other in f.systems))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += ["**atlasfs without FUSE (in-process limits)**", "", "| figure | unit | atlasfs |", "| --- | --- | --- |"]
    for f in FIGURES:
        if f.table == "inprocess":
            lines.append(f"| {_md(f.label)} | {f.unit} | {cell(results.stats(f.id, 'atlasfs'))} |")
    lines.append("")
    missing = [f"{s} {f.id} ({f.label}, {f.unit}): {results.missing[f.id][s]}" for f in FIGURES
               for s in f.systems if s not in unavailable and s in results.missing.get(f.id, {})]
    if missing:
        lines += ["**Missing figures:**", ""] + [f"- {_md(m)}" for m in missing] + [""]
    problems = results.mismatches()
    if problems:
        lines += ["**Answers that differ (figures above may be wrong):**", ""]
        lines += [f"- {p}" for p in problems]
        lines.append("")
    return lines


def targets_table(targets: list[Target]) -> list[str]:
    """The Markdown table of targets."""
    lines = ["| dataset | target | measured (median; ratios are atlasfs ÷ the other) | runs' range | met? |",
             "| --- | --- | --- | --- | --- |"]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "missing"}[t.met]
        if t.borderline:
            met += " (borderline: the range straddles the threshold)"
        f = fmt_ratio if t.is_ratio else fmt
        rng = f"{f(t.low)}–{f(t.high)}" if t.low is not None and t.high is not None else ""
        note = f" ({t.note})" if t.note else ""
        value = fmt_ratio(t.measured) if t.is_ratio else f"{fmt(t.measured)} {t.unit}"
        lines.append(f"| {t.dataset} | {_md(t.text + note)} | {value} | {rng} | {met} |")
    return lines


def markdown(meta: dict[str, Any], infos: dict[str, dict[str, Any]], all_results: dict[str, Results],
             targets: list[Target]) -> list[str]:
    """The report's body (the harness writes the header: date, code, host, command, notes)."""
    lines = [f"ratarmount: {meta['ratarmount']}; {meta['repeat']} repeat(s) a figure, shown as median (min–max); "
             f"{meta['random_reads']:,} random reads a pass.", ""]
    lines.append("MB = 10^6 bytes of file content (tar headers not counted). *Cold* = a fresh mount (new daemon: "
                 "empty block cache, no kernel cache for that mount); the backing files (Atlas `data.bin`, tars) "
                 "stay in the page cache, nothing is dropped system-wide. **tmpfs has no cold state: its cold "
                 "figures are simply its first pass.** *Stored*: atlasfs file tables (`atlasfs index`) and "
                 "ratarmount `.index.sqlite` files built ahead; *first mount ever*: both removed before mounting. "
                 "Random reads are `open().read()` in the benchmark's own process, so no fork per file.")
    lines.append("")
    lines += ["## Targets", ""] + targets_table(targets) + [""]
    lines += ["## Figures", ""]
    for name, results in all_results.items():
        lines += dataset_tables(name, infos[name], results, meta.get("unavailable", {}))
    return lines


def to_json(infos: dict[str, dict[str, Any]], all_results: dict[str, Results],
            targets: list[Target]) -> dict[str, Any]:
    """The report as plain data (the harness adds its ``meta``); a missing figure is ``{"missing": reason}``,
    never 0."""
    datasets = {}
    for name, results in all_results.items():
        figures = {}
        for f in FIGURES:
            figures[f.id] = {
                "label": f.label, "unit": f.unit, "better": "higher" if f.higher_is_better else "lower",
                "systems": {s: results.stats(f.id, s) for s in f.systems},
                "ratios": {f"atlasfs/{o}": ratio(results, f.id, o) for o in ("tmpfs", "ratarmount") if o in f.systems},
            }
        datasets[name] = {"info": infos[name], "figures": figures, "answers": results.answers,
                          "mismatches": results.mismatches()}
    return {"datasets": datasets, "targets": [t.as_dict() for t in targets]}
