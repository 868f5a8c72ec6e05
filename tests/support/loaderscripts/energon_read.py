"""Read samples of a dataset folder with Megatron-Energon (7.4.1); print them as JSON.

python energon_read.py PATH train|val SPLIT_PART WORKERS COUNT
Each sample: its key and, per part, the SHA-256 of its bytes (no decoding: the bytes as stored).
"""
import hashlib
import json
import sys
from dataclasses import dataclass

from megatron.energon import (Cooker, DefaultTaskEncoder, Sample, WorkerConfig, basic_sample_keys, get_loader,
                              get_train_dataset, get_val_dataset, stateless)


@dataclass
class Raw(Sample):
    parts: dict


@stateless
def cook(sample: dict) -> Raw:
    parts = {k: hashlib.sha256(v).hexdigest() for k, v in sample.items()
             if not k.startswith("__") and isinstance(v, bytes)}
    return Raw(**basic_sample_keys(sample), parts=parts)


class Encoder(DefaultTaskEncoder):
    decoder = None  # the parts' bytes as stored
    cookers = [Cooker(cook)]

    def batch(self, samples):
        return samples


def main() -> None:
    path, kind, split, workers, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    config = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    if kind == "train":
        ds = get_train_dataset(path, split_part=split, worker_config=config, batch_size=1, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, task_encoder=Encoder())
    else:
        ds = get_val_dataset(path, split_part=split, worker_config=config, batch_size=1, task_encoder=Encoder())
    out = []
    for batch in get_loader(ds):
        out += [{"key": s.__key__, "parts": s.parts} for s in batch]
        if len(out) >= count:
            break
    print(json.dumps(out))


if __name__ == "__main__":
    main()
