"""The Ray cluster of the benchmarks' ``--ray`` columns: one local cluster for the whole run
(``ray.init`` here, two CPUs: this machine's), its address handed to each timed command
(``--ray ADDRESS``), so that a column times the command on a running cluster; the start-up
of a cluster for one command is timed once beside it (:func:`startup_seconds`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def cluster(cpus: int = 2) -> Iterator[str]:
    """A local Ray cluster for the duration; its address."""
    import ray
    # "local": a cluster of its own, even while another runs here (`ray start`, a test's Cluster)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def startup_seconds(dataset: str) -> float:
    """Seconds of ``atlasfs verify DATASET --ray`` with no address (a cluster started for the
    command and ended with it) less those of the same verify with ``-j``'s processes: what
    starting and stopping a local cluster adds to one command."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def seconds(*extra: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "atlasfs", "verify", dataset, *extra], check=True,
                       stdout=subprocess.DEVNULL, env=env)
        return time.perf_counter() - start
    return seconds("--ray") - seconds()
