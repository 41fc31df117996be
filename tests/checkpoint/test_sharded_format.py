"""The index entries of sharded tensor pieces: a piece must lie inside the whole tensor it names."""

from __future__ import annotations

import pytest

from crashproof.checkpoint.format._rank_index import TensorEntry, _parse_tensor
from crashproof.errors import CorruptCheckpointError


def _entry(**changes: object) -> dict[str, object]:
    entry = TensorEntry(
        "model/0.weight", "float32", (3, 5), 0, 60, "c0ffee", None, (7, 5), (3, 0)
    ).to_json()
    entry.update(changes)
    return entry


def test_a_piece_round_trips_with_its_place_in_the_whole() -> None:
    parsed = _parse_tensor(_entry(), "rank_00001.json", 60)
    assert parsed.global_shape == (7, 5) and parsed.global_offset == (3, 0)
    assert _entry()["global"] == {"shape": [7, 5], "offset": [3, 0]}


@pytest.mark.parametrize(
    ("placement", "why"),
    [
        ({"shape": [7, 5], "offset": [5, 0]}, "does not fit"),  # rows 5..8 of 7
        ({"shape": [7], "offset": [0]}, "1-d tensor"),
        ({"shape": [7, 5], "offset": [0, -1]}, "dim"),
        ({"shape": [7, 5]}, "shape"),
        ([7, 5], "not an object"),
    ],
)
def test_a_piece_outside_its_whole_tensor_is_refused(placement: object, why: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=why):
        _parse_tensor(_entry(**{"global": placement}), "rank_00001.json", 60)
