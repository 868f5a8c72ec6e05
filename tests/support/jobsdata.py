"""The dataset of the tests of commands run over shards in parallel processes (-j)."""

from __future__ import annotations

import random
from pathlib import Path


def jobs_dataset(path: Path) -> Path:
    """Five shards of samples in sub-folders, one file bigger than export's 1 MiB pieces."""
    from atlasfs import AtlasWriter
    rng = random.Random(3)
    with AtlasWriter(path, shard_size=12, block_size=4, compression_strategy=1) as writer:
        for i in range(55):
            writer.add_example({"__key__": f"d{i % 3}/s{i:03d}", "bin": rng.randbytes(rng.randrange(1, 3000)),
                                "json": {"i": i}, **({"big": rng.randbytes(2_500_000)} if i == 17 else {})})
    return path


# The work of test_jobs' worker processes: here, not in the test module, so that a worker
# imports only this small module (importing the test module copied the reference fixtures in
# every worker, left behind by one that dies, and failed while the tests were being moved).


def no_state(source: object) -> None:
    """A worker's state: none."""
    return None


def dies_on_shard_2(state: object, s: int, report: object) -> object:
    """A worker's work that ends its process on shard 2, as a crash in a decoder would."""
    import os
    from atlasfs.commands.jobs import Done
    if s == 2:
        os._exit(3)
    return Done(s, value=os.getpid())
