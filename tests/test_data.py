"""Tests for linattn.training.data: byte corpus, batch stream, and the synthetic tasks."""

import re
import statistics
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.training.data import (
    IGNORE_INDEX,
    LISTOPS_CLS,
    LISTOPS_PAD,
    LISTOPS_TOKENS,
    MQAR_CONFIGS,
    ByteLMBatches,
    ClassificationBatch,
    Corpus,
    TaskBatch,
    copy_task,
    corpus_files,
    eval_batches,
    listops_decode,
    listops_evaluate,
    listops_expression,
    listops_task,
    load_corpus,
    mqar_task,
)

# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus():
    return Corpus.load()


def test_stdlib_corpus_loads_and_is_large(stdlib_corpus):
    c = stdlib_corpus
    assert c.n_bytes > 1_000_000
    assert c.n_files > 100
    assert c.train.dtype == torch.uint8 and c.validation.dtype == torch.uint8
    text = "".join(chr(b) for b in c.train[:20000].tolist())
    assert "def " in text and "import" in text
    d = c.describe()
    assert f"{c.n_files} files" in d and f"{c.n_bytes:,} bytes" in d and "standard library" in d
    assert "site-packages" not in " ".join(str(p) for p in corpus_files())


def test_stdlib_split_is_deterministic_and_disjoint(stdlib_corpus):
    c = stdlib_corpus
    assert c.train.numel() + c.validation.numel() == c.n_bytes
    assert c.validation.numel() == int(c.n_bytes * c.val_fraction)
    whole = load_corpus()
    assert len(whole) == c.n_bytes
    # train is exactly the head, validation exactly the tail: disjoint and covering
    assert bytes(c.train[:4096].tolist()) == whole[:4096]
    assert bytes(c.train[-4096:].tolist()) == whole[c.train.numel() - 4096 : c.train.numel()]
    assert bytes(c.validation.tolist()) == whole[c.train.numel():]
    again = Corpus.load()
    assert torch.equal(again.train, c.train) and torch.equal(again.validation, c.validation)


def test_max_bytes_caps_the_corpus():
    c = Corpus.load(max_bytes=50_000, val_fraction=0.1)
    assert c.n_bytes == 50_000
    assert c.validation.numel() == 5_000
    assert load_corpus(max_bytes=50_000) == bytes(torch.cat([c.train, c.validation]).tolist())


def test_user_folder_and_file(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    (folder / "b.txt").write_bytes(b"second file\n")
    (folder / "a.txt").write_bytes(b"first file\n")
    (folder / "sub" / "c.md").write_bytes(b"nested\n")
    (folder / ".hidden" / "x.txt").write_bytes(b"hidden\n")
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    single = tmp_path / "single.txt"
    single.write_bytes(b"just one file, a bit longer than the others\n")

    assert load_corpus(folder) == b"first file\nsecond file\nnested\n"
    assert load_corpus(str(single)) == single.read_bytes()
    assert load_corpus([single, folder]) == single.read_bytes() + b"first file\nsecond file\nnested\n"
    assert load_corpus(folder, suffixes=[".md"]) == b"nested\n"
    assert load_corpus(folder, max_bytes=15) == b"first file\nseco"

    c = Corpus.load([folder, single], val_fraction=0.25)
    whole = b"first file\nsecond file\nnested\n" + single.read_bytes()
    assert c.n_files == 4 and c.n_bytes == len(whole)
    assert bytes(c.train.tolist()) + bytes(c.validation.tolist()) == whole
    assert c.validation.numel() == int(len(whole) * 0.25)
    assert str(folder) in c.describe()


def test_missing_path_error_names_the_path(tmp_path):
    missing = tmp_path / "no_such_dir" / "corpus.txt"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_corpus([missing])
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        Corpus.load(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no usable files"):
        Corpus.load(empty)


def test_corpus_smaller_than_window_errors(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"0123456789" * 3)
    c = Corpus.load(f, val_fraction=0.1)
    with pytest.raises(ValueError, match="seq_len"):
        c.batches("validation", seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        ByteLMBatches(torch.zeros(10, dtype=torch.uint8), seq_len=10, batch_size=1)
    ByteLMBatches(torch.zeros(11, dtype=torch.uint8), seq_len=10, batch_size=1)  # exactly enough


# ------------------------------------------------------------------------------------------------
# Batch streams
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_data():
    return torch.randint(256, (5000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def test_byte_batches_shapes_and_shift(byte_data):
    stream = ByteLMBatches(byte_data, seq_len=32, batch_size=8, seed=3)
    x, y = next(stream)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = byte_data.long()
    for row_x, row_y in zip(x, y):  # every window is a real slice of the data
        starts = [s for s in range(len(data) - 32) if torch.equal(data[s : s + 32], row_x)]
        assert starts and torch.equal(data[starts[0] + 1 : starts[0] + 33], row_y)


def test_byte_batches_deterministic_and_seeded(byte_data):
    a = ByteLMBatches(byte_data, 16, 4, seed=1)
    b = ByteLMBatches(byte_data, 16, 4, seed=1)
    c = ByteLMBatches(byte_data, 16, 4, seed=2)
    for _ in range(5):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
    x0, _ = ByteLMBatches(byte_data, 16, 4, seed=1).batch(0)
    x1, _ = ByteLMBatches(byte_data, 16, 4, seed=1).batch(1)
    assert not torch.equal(x0, x1)


def test_byte_batches_resume(byte_data):
    reference = ByteLMBatches(byte_data, 16, 4, seed=7)
    expected = [next(reference) for _ in range(10)]

    run = ByteLMBatches(byte_data, 16, 4, seed=7)
    for _ in range(6):
        next(run)
    state = run.state_dict()
    assert state["step"] == 6

    resumed = ByteLMBatches(byte_data, 16, 4, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    for want in expected[6:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    with pytest.raises(ValueError, match="batch_size"):
        ByteLMBatches(byte_data, 16, 5).load_state_dict(state)
    with pytest.raises(ValueError, match="n_bytes"):
        ByteLMBatches(byte_data[:-1], 16, 4).load_state_dict(state)


def test_eval_batches_cover_data_in_order(byte_data):
    batches = list(eval_batches(byte_data, seq_len=100, batch_size=16))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    n = (5000 - 1) // 100
    assert x.shape == (n, 100)
    assert torch.equal(x.flatten(), byte_data[: n * 100].long())
    assert torch.equal(y.flatten(), byte_data[1 : n * 100 + 1].long())
    assert len(list(eval_batches(byte_data, 100, 16, max_batches=2))) == 2


# ------------------------------------------------------------------------------------------------
# Copy task
# ------------------------------------------------------------------------------------------------


def check_copy(batch: TaskBatch, n: int, max_len: int, n_symbols: int, min_len: int = 1):
    sep, T = n_symbols + 1, 2 * max_len + 1
    assert batch.vocab_size == n_symbols + 2
    assert batch.inputs.shape == batch.targets.shape == (n, T)
    for x, y in zip(batch.inputs.tolist(), batch.targets.tolist()):
        L = x.index(sep)
        assert min_len <= L <= max_len
        src = x[:L]
        assert all(1 <= s <= n_symbols for s in src)
        assert x[L + 1 : 2 * L + 1] == src
        assert all(t == 0 for t in x[2 * L + 1 :])
        assert y[L : 2 * L] == src  # targets are the source symbols, in order
        assert all(t == IGNORE_INDEX for t in y[:L] + y[2 * L :])


def test_copy_task_targets_are_the_source():
    batch = copy_task(64, max_len=20, n_symbols=10, seed=0)
    check_copy(batch, 64, 20, 10)
    assert int(batch.loss_mask.sum()) == sum(row.index(11) for row in batch.inputs.tolist())
    default = copy_task(8, seed=1)  # the paper's setting: up to 128 symbols from 10
    check_copy(default, 8, 128, 10)


def test_copy_task_determinism():
    a, b, c = copy_task(16, seed=5), copy_task(16, seed=5), copy_task(16, seed=6)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    g = torch.Generator().manual_seed(5)
    first, second = copy_task(16, generator=g), copy_task(16, generator=g)
    assert torch.equal(first.inputs, a.inputs) and not torch.equal(first.inputs, second.inputs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6),
    max_len=st.integers(1, 24),
    n_symbols=st.integers(1, 30),
    min_frac=st.floats(0, 1),
    seed=st.integers(0, 2**31),
)
def test_copy_task_property(n, max_len, n_symbols, min_frac, seed):
    min_len = max(1, int(min_frac * max_len))
    check_copy(copy_task(n, max_len, n_symbols, min_len, seed=seed), n, max_len, n_symbols, min_len)


# ------------------------------------------------------------------------------------------------
# MQAR
# ------------------------------------------------------------------------------------------------


def check_mqar(batch: TaskBatch, n: int, seq_len: int, n_pairs: int, vocab_size: int):
    half = vocab_size // 2
    assert batch.vocab_size == vocab_size
    assert batch.inputs.shape == batch.targets.shape == (n, seq_len)
    assert int(batch.inputs.min()) >= 0 and int(batch.inputs.max()) < vocab_size
    for x, y in zip(batch.inputs.tolist(), batch.targets.tolist()):
        keys, values = x[0 : 2 * n_pairs : 2], x[1 : 2 * n_pairs : 2]
        assert len(set(keys)) == n_pairs and len(set(values)) == n_pairs  # unique per sequence
        assert all(1 <= k < half for k in keys) and all(half <= v < vocab_size for v in values)
        pairs = dict(zip(keys, values))
        scored = [t for t in range(seq_len) if y[t] != IGNORE_INDEX]
        assert len(scored) == n_pairs
        assert all(t >= 2 * n_pairs and (t - 2 * n_pairs) % 2 == 0 for t in scored)
        assert sorted(x[t] for t in scored) == sorted(keys)  # every key is queried once
        for t in scored:  # the target after each query is the value paired with it earlier
            assert y[t] == pairs[x[t]]


@pytest.mark.parametrize("seq_len,n_pairs", MQAR_CONFIGS)
def test_mqar_configs(seq_len, n_pairs):
    assert MQAR_CONFIGS == ((64, 4), (128, 8), (256, 16))
    batch = mqar_task(200, seq_len, n_pairs, seed=seq_len)
    check_mqar(batch, 200, seq_len, n_pairs, 8192)
    # queries come in random order, not in the order of the pairs
    orders = {tuple(int(batch.inputs[i, t]) for t in batch.loss_mask[i].nonzero().flatten()) ==
              tuple(batch.inputs[i, 0 : 2 * n_pairs : 2].tolist()) for i in range(200)}
    assert False in orders


def test_mqar_docstring_layout():
    batch = mqar_task(300, 16, 2, 12, random_non_queries=False, seed=0)
    check_mqar(batch, 300, 16, 2, 12)
    non_pairs = batch.inputs[:, 4:]
    assert set(non_pairs[~batch.loss_mask[:, 4:]].tolist()) == {0}


def test_mqar_determinism_and_speed():
    a, b, c = (mqar_task(32, 128, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(mqar_task(32, 128, 8, generator=g).inputs, a.inputs)
    assert not torch.equal(mqar_task(32, 128, 8, generator=g).inputs, a.inputs)
    start = time.perf_counter()
    big = mqar_task(10_000, 256, 16, seed=0)
    elapsed = time.perf_counter() - start
    assert big.inputs.shape == (10_000, 256)
    assert elapsed < 5.0, f"10k MQAR(256, 16) samples took {elapsed:.2f} s"  # ~0.15 s when idle


def test_mqar_invalid_arguments():
    with pytest.raises(ValueError, match="4 \\* n_pairs"):
        mqar_task(1, 15, 4)
    with pytest.raises(ValueError, match="key ids"):
        mqar_task(1, 64, 4, vocab_size=8)
    with pytest.raises(ValueError, match="either seed or generator"):
        mqar_task(1, seed=0, generator=torch.Generator())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 8),
    n_pairs=st.integers(1, 12),
    extra=st.integers(0, 40),
    vocab_extra=st.integers(0, 300),
    random_non_queries=st.booleans(),
    power_a=st.sampled_from([0.01, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_mqar_property(n, n_pairs, extra, vocab_extra, random_non_queries, power_a, seed):
    seq_len = 4 * n_pairs + extra
    vocab_size = 2 * (n_pairs + 1) + vocab_extra
    batch = mqar_task(n, seq_len, n_pairs, vocab_size, power_a=power_a,
                      random_non_queries=random_non_queries, seed=seed)
    check_mqar(batch, n, seq_len, n_pairs, vocab_size)


# ------------------------------------------------------------------------------------------------
# ListOps
# ------------------------------------------------------------------------------------------------


def reference_listops(expression: str):
    """Independent evaluator: recursive descent over the LRA string. Returns (value, bracket
    nesting depth, argument counts of all operators). MED as in LRA: int(np.median(args))."""
    tokens = expression.split()
    arg_counts = []

    def parse(i):
        tok = tokens[i]
        if tok.isdigit():
            return int(tok), i + 1, 0
        assert tok.startswith("[")
        args, depth, i = [], 0, i + 1
        while tokens[i] != "]":
            v, i, d = parse(i)
            args.append(v)
            depth = max(depth, d)
        arg_counts.append(len(args))
        name = tok[1:]
        if name == "MIN":
            v = min(args)
        elif name == "MAX":
            v = max(args)
        elif name == "MED":
            v = int(statistics.median(args))
        elif name == "SM":
            v = sum(args) % 10
        else:
            raise AssertionError(f"unknown operator {tok}")
        return v, i + 1, depth + 1

    value, end, depth = parse(0)
    assert end == len(tokens), "trailing tokens"
    return value, depth, arg_counts


def test_reference_evaluator_examples():
    assert reference_listops("[MAX 4 3 [MIN 2 3 ] 1 0 ]") == (4, 2, [2, 5])
    assert reference_listops("[MED 1 4 ]")[0] == 2  # LRA: int(np.median) = int(2.5)
    assert listops_evaluate("[MED 1 4 ]") == 2 and listops_evaluate("[MED 9 0 5 ]") == 5
    assert listops_evaluate("[SM 9 8 [MAX 1 7 ] ]") == 4


@pytest.mark.parametrize(
    "max_depth,max_args,min_len,max_len",
    [(10, 10, 16, 128), (4, 3, 5, 40), (6, 8, 60, 200)],
)
def test_listops_labels_and_limits(max_depth, max_args, min_len, max_len):
    n = 150
    batch = listops_task(n, max_depth, max_args, min_len, max_len, seed=max_len)
    assert isinstance(batch, ClassificationBatch)
    assert batch.vocab_size == len(LISTOPS_TOKENS) == 17 and batch.num_classes == 10
    assert batch.inputs.shape == batch.mask.shape == (n, max_len + 1) and batch.labels.shape == (n,)
    assert batch.mask.dtype == torch.bool
    for i in range(n):
        row = batch.inputs[i]
        length = int(batch.mask[i].sum())
        assert batch.mask[i, :length].all() and not batch.mask[i, length:].any()  # right padding
        assert (row[length:] == LISTOPS_PAD).all()
        assert int(batch.cls_index[i]) == length - 1 and int(row[length - 1]) == LISTOPS_CLS
        expression = listops_decode(row)
        value, depth, arg_counts = reference_listops(expression)
        assert value == int(batch.labels[i])
        assert min_len <= len(expression.split()) == length - 1 <= max_len
        assert 1 <= depth <= max_depth - 1
        assert all(2 <= a <= max_args for a in arg_counts)
    assert len(set(batch.labels.tolist())) > 3


def test_listops_cls_first_and_determinism():
    a = listops_task(20, 5, 4, 8, 64, cls_position="first", seed=1)
    assert (a.inputs[:, 0] == LISTOPS_CLS).all() and (a.cls_index == 0).all()
    b = listops_task(20, 5, 4, 8, 64, cls_position="last", seed=1)
    for i in range(20):  # same expressions, CLS moved
        assert listops_decode(a.inputs[i]) == listops_decode(b.inputs[i])
    assert torch.equal(a.labels, b.labels)
    c = listops_task(20, 5, 4, 8, 64, cls_position="first", seed=1)
    d = listops_task(20, 5, 4, 8, 64, cls_position="first", seed=2)
    assert torch.equal(a.inputs, c.inputs) and not torch.equal(a.inputs, d.inputs)
    g = torch.Generator().manual_seed(3)
    assert not torch.equal(listops_task(5, generator=g).inputs, listops_task(5, generator=g).inputs)


def test_listops_expression_string():
    for seed in range(30):
        text, value = listops_expression(6, 5, 10, 80, seed=seed)
        ref, depth, _ = reference_listops(text)
        assert value == ref == listops_evaluate(text)
        assert 10 <= len(text.split()) <= 80 and depth <= 5
    assert listops_expression(seed=4) == listops_expression(seed=4)


def test_listops_invalid_arguments():
    with pytest.raises(ValueError, match="longer than any expression"):
        listops_task(1, max_depth=2, max_args=3, min_len=10, max_len=20)
    with pytest.raises(ValueError, match="min_len"):
        listops_task(1, min_len=50, max_len=40)
    with pytest.raises(ValueError, match="cls_position"):
        listops_task(1, cls_position="middle")


def test_batches_move_to_device():
    t = copy_task(2, 4, seed=0).to("cpu")
    assert isinstance(t, TaskBatch) and t.vocab_size == 12
    c = listops_task(2, 3, 3, 4, 20, seed=0).to("cpu")
    assert isinstance(c, ClassificationBatch) and c.num_classes == 10
