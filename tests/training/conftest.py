"""Fixtures of the linattn.training tests: one thread, a small text corpus."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("corpus")
    words = ["alpha", "beta", "gamma", "delta", "linear", "attention", "kernel", "state", "the", "a"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(len(words), (6000,), generator=g).tolist()
    (d / "text.txt").write_text(" ".join(words[i] for i in idx), encoding="utf-8")
    return str(d)
