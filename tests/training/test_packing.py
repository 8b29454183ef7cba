"""linattn.training.packing: documents (corpus files) packed into full rows for the byte LM, kept apart
by cu_seqlens; the option in TrainConfig (on by default for task "bytes")."""

from __future__ import annotations

import pytest
import torch

from linattn.training import data as D
from linattn.models import LinearTransformerLM, ModelConfig
from linattn.training import TrainConfig, train
from linattn.training import packing as P
from linattn.training.tasks import BytesTask

from .helpers import TINY_MODEL, bytes_config


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    """Six files of different lengths (one document each)."""
    d = tmp_path_factory.mktemp("docs")
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate([40, 7, 130, 1, 75, 300]):
        text = bytes(torch.randint(97, 123, (n,), generator=g).tolist())
        (d / f"f{i}.txt").write_bytes(text)
    return str(d)


def test_corpus_records_document_starts(docs):
    corpus = D.Corpus.load(docs, val_fraction=0.2)
    assert corpus.doc_starts.tolist() == [0, 40, 47, 177, 178, 253]
    n_train = corpus.train.numel()  # 553 · 0.8
    assert P.split_starts(corpus, "train").tolist() == [s for s in [0, 40, 47, 177, 178, 253] if s < n_train]
    assert P.split_starts(corpus, "validation").tolist() == [0]  # the last file, cut by the split


def test_pack_windows_marks_documents_and_ignores_their_last_targets():
    data = torch.arange(20, dtype=torch.uint8)
    doc_starts = torch.tensor([0, 5, 6, 14])
    b = P.pack_windows(data, torch.tensor([3, 0]), 8, doc_starts)
    assert b.inputs[0].tolist() == list(range(3, 11)) and b.inputs[1].tolist() == list(range(0, 8))
    assert b.starts[0].tolist() == [True, False, True, True, False, False, False, False]  # row start, bytes 5, 6
    ign = D.IGNORE_INDEX
    assert b.targets[0].tolist() == [4, ign, ign, 7, 8, 9, 10, 11]  # 4 → 5 and 5 → 6 cross a document start
    assert b.cu_seqlens().tolist() == [0, 2, 3, 8, 13, 14, 16]  # rows laid end to end: 3 | 0, 5, 6
    sub = b.rows(1, 2)
    assert torch.equal(sub.starts, b.starts[1:]) and sub.cu_seqlens().tolist() == [0, 5, 6, 8]


def test_packed_stream_takes_the_stream_windows(docs):
    corpus = D.Corpus.load(docs, val_fraction=0.2)
    stream = D.ByteLMBatches(corpus.train, 16, 4, seed=3)
    for step in (0, 5):
        b = P.packed_stream_batch(stream, step, P.split_starts(corpus, "train"))
        x, y = stream.batch(step)
        assert torch.equal(b.inputs, x)
        keep = b.targets != D.IGNORE_INDEX
        assert torch.equal(b.targets[keep], y[keep])
        assert (b.targets[:, :-1][b.starts[:, 1:]] == D.IGNORE_INDEX).all()  # a document's last byte predicts nothing
        assert (~keep).sum() >= b.starts[:, 1:].sum() and b.starts[:, 0].all()


def test_packed_loss_is_the_documents_loss(docs):
    """loss_stats of a packed batch = Σ over its documents of the loss of each one alone."""
    task = BytesTask(seq_len=24, batch_size=3, seed=0, eval_batches=1, corpus=[docs], val_fraction=0.2, packing=True)
    model = LinearTransformerLM(ModelConfig(vocab_size=256, max_len=24, short_conv=3, **TINY_MODEL)).double()
    batch = task.train_batch(2)
    loss, _ = task.loss_stats(model, batch)
    want = 0.0
    for r in range(batch.inputs.shape[0]):
        begin = batch.starts[r].nonzero().reshape(-1).tolist() + [batch.inputs.shape[1]]
        for s, e in zip(begin, begin[1:]):
            logits, _ = model(batch.inputs[r:r + 1, s:e])
            want = want + torch.nn.functional.cross_entropy(logits[0], batch.targets[r, s:e],
                                                            ignore_index=D.IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    assert task.scored(batch) == int((batch.targets != D.IGNORE_INDEX).sum())


def test_packed_training_runs(docs, tmp_path):
    cfg = bytes_config(docs, seq_len=16, val_fraction=0.2, steps=4, eval_interval=2)
    assert cfg.packing is None and TrainConfig.from_dict(cfg.to_dict()).packing is None
    res = train(cfg, progress=False)
    assert res.status == "completed" and all(torch.isfinite(torch.tensor(res.losses)))
    assert BytesTask.from_config(cfg).packing  # on by default for the byte corpus
    off = train(bytes_config(docs, seq_len=16, val_fraction=0.2, steps=4, eval_interval=2, packing=False),
                progress=False)
    assert off.losses != res.losses  # the documents change what is predicted


@pytest.mark.parametrize("kind", ["lolcats", "swa"])
def test_packed_training_runs_with_the_window_kinds(docs, kind):
    """Issue 37 item 8: `linattn train --attention lolcats` (and `eval --preset quick`, whose byte task
    packs by default) died: "LoLCATsAttention does not take packed sequences yet"."""
    model = {**TINY_MODEL, "attention": [kind], "kind_options": {kind: {"window": 4}}}
    res = train(bytes_config(docs, seq_len=16, val_fraction=0.2, steps=2, eval_interval=2, model=model),
                progress=False)
    assert res.status == "completed" and all(torch.isfinite(torch.tensor(res.losses)))


def test_packing_config_errors():
    with pytest.raises(ValueError, match="packing=True is for task 'bytes'"):
        TrainConfig(task="mqar", packing=True, task_options={"seq_len": 16, "n_pairs": 2, "vocab_size": 32})
    with pytest.raises(ValueError, match="packing"):
        TrainConfig(task="bytes", packing="yes")
