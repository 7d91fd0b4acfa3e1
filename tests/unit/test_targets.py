"""Target selection for magics and Cluster calls: ranks, lists, slices, clear errors."""

import pytest

from nbtrain.notebook.targets import one_rank, select_ranks


@pytest.mark.parametrize(
    "targets,ranks",
    [
        (None, [0, 1, 2, 3]),
        (2, [2]),
        (-1, [3]),
        ("0,2", [0, 2]),
        ("0:2", [0, 1]),
        ("::2", [0, 2]),
        ("1:", [1, 2, 3]),
        ("-1", [3]),
        ("2,0:2", [0, 1, 2]),
        (slice(1, 3), [1, 2]),
        ([3, 0, 3], [0, 3]),
    ],
)
def test_select_ranks(targets, ranks):
    assert select_ranks(targets, 4) == ranks


@pytest.mark.parametrize(
    "targets,message",
    [
        ("4", "target 4 is out of range: ranks are 0..3"),
        ("a", "target 'a' is not a rank"),
        ("3:1", "select no rank"),
        ([1.5], "is not a rank"),
        ("1:2:3:4", "not a rank or a slice"),
    ],
)
def test_bad_targets_name_the_value_and_the_range(targets, message):
    with pytest.raises(ValueError, match=message):
        select_ranks(targets, 4)


def test_one_rank():
    assert one_rank(1) and one_rank("-1") and one_rank(" 2")
    assert not one_rank("0,1") and not one_rank(None) and not one_rank("0:1")
