"""linattn.models.huge_pages (models/pages.py): large CPU tensors asked onto 2 MB pages, values unchanged; small, tied and
non-plain tensors skipped; bad input refused."""

import sys

import pytest
import torch
from torch import nn

from linattn.models.pages import HUGE_PAGE, huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _thp_never() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" in f.read()
    except OSError:
        return True


@linux
def test_large_weights_counted_once_and_values_kept():
    if _thp_never():
        pytest.skip("transparent huge pages are off on this machine")
    big = nn.Linear(1024, 2048, bias=False)  # 8 MB: at least 2 whole huge pages inside its storage
    small = nn.Linear(16, 16)
    model = nn.Sequential(big, small)
    before = big.weight.detach().clone()
    n = huge_pages(model, collapse=False)
    storage = big.weight.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    expected = (end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    assert n == expected >= 3 * HUGE_PAGE
    assert huge_pages([big.weight, big.weight, small.weight], collapse=False) == expected  # once, small skipped
    assert torch.equal(big.weight, before)
    collapsed = huge_pages(model)  # MADV_COLLAPSE: the whole range, or 0 where the kernel refuses it
    assert collapsed in (0, expected) and torch.equal(big.weight, before)


def test_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError, match="huge_pages: expected a module or tensors, got a str"):
        huge_pages(["weights"])


def test_small_and_non_cpu_tensors_are_left_alone():
    assert huge_pages([torch.zeros(10), torch.zeros(0)]) == 0
    assert huge_pages([torch.zeros(HUGE_PAGE // 4, device="meta")]) == 0
