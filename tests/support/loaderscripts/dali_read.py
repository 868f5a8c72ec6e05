"""Read every sample of tars with DALI's CPU webdataset reader (2.4.0); print them as JSON.

python dali_read.py TAR,TAR,... INDEX,INDEX,...|"" EXT,EXT,...
Each sample: the SHA-256 of each asked extension's bytes, in the reader's order.
"""
import hashlib
import json
import sys

from nvidia.dali import fn, pipeline_def, types


def main() -> None:
    tars, exts = sys.argv[1].split(","), sys.argv[3].split(",")
    indexes = [i for i in sys.argv[2].split(",") if i] or None

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)  # CPU only: no GPU needed
    def pipe():  # noqa: ANN202
        return tuple(fn.readers.webdataset(paths=tars, index_paths=indexes, ext=exts, name="reader",
                                           missing_component_behavior="error", dtypes=[types.UINT8] * len(exts),
                                           random_shuffle=False))

    p = pipe()
    p.build()
    size = p.epoch_size("reader")
    samples = []
    for _ in range(size):
        samples.append([hashlib.sha256(out.at(0).tobytes()).hexdigest() for out in p.run()])
    print(json.dumps({"size": size, "samples": samples}))


if __name__ == "__main__":
    main()
