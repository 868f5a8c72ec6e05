"""The safe loader's budget: allowed constructors cannot turn a small pickle into huge memory."""

from __future__ import annotations

import pickle
from typing import Any, Callable

import numpy as np
import pytest

from atlasfs import AtlasFormatError
from atlasfs.formats import safepickle


class Call:
    """Pickles to ``func(*args)``."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


@pytest.mark.parametrize("payload", [
    Call(bytes, 10**12), Call(bytearray, 10**11), Call(list, range(10**12)), Call(tuple, range(10**9)),
    Call(set, range(10**9)),
])
def test_allowed_constructors_cannot_amplify_memory(payload: Call) -> None:
    with pytest.raises(AtlasFormatError, match="far more data"):
        safepickle.loads(pickle.dumps(payload), trust=False, where="block")


def test_one_memoised_object_expanded_many_times_is_refused() -> None:
    big = b"x" * (1 << 20)
    # list(big) a thousand times over one memoised bytes object: ~1 MB of pickle, ~8 GB of ints
    hostile = pickle.dumps([big] + [Call(list, big) for _ in range(1000)])
    assert len(hostile) < 2 << 20
    with pytest.raises(AtlasFormatError, match="far more data"):
        safepickle.loads(hostile, trust=False, where="block")


def test_numpy_ndarray_cannot_be_called_directly() -> None:
    hostile = pickle.dumps(Call(np.ndarray, (10**6, 10**6)))
    with pytest.raises(AtlasFormatError):
        safepickle.loads(hostile, trust=False, where="block")
    # the same global as _reconstruct's argument, as numpy pickles it, is fine
    assert (safepickle.loads(pickle.dumps(np.arange(3)), trust=False, where="block") == np.arange(3)).all()


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_in_every_protocol_stays_within_budget(protocol: int) -> None:
    value = [bytearray(b"ab" * 1000), {1, 2}, frozenset({3}), complex(1, 2), b"x" * 5000, "s" * 5000,
             np.arange(1000), np.array(["a", "bb"]), list(range(1000)), (1, 2), {"k": [1.5] * 100}]
    assert repr(safepickle.loads(pickle.dumps(value, protocol=protocol), trust=False, where="b")) == repr(value)
