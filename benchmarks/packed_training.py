"""Packed vs padded byte-LM training throughput (issue 24), side by side in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/packed_training.py [--kinds linear,gated_deltanet,softmax]
        [--seq-len 256 1024] [--batch-size 8] [--rounds 3] [--min-run-time 1.0] [--threads 1] [--cross 0]

One training step (loss, backward, AdamW) of `linattn train`'s default byte model (d_model 128,
2 layers, 4 heads, RoPE; the attention kind per row) on the standard-library corpus, one file = one
document, on the same B random windows of T + 1 bytes each way:

  packed    the windows as they are: B·T real tokens, documents kept apart by cu_seqlens
            (linattn.training.packing, what `linattn train` does for the byte corpus); where the
            mixer takes the fused CPU kernels, one kernel call per layer for the whole packed row
  per-length  the same packed rows with linattn.ops.packed.IN_KERNELS off: one operator call per
            distinct sequence length (how packed rows ran before the kernels took cu_seqlens)
  padded    one document per row, as a trainer without packing feeds them: B rows that begin at
            random document starts, each cut at the end of its document, the rest padding (a
            key-padding mask; the loss skips it)
  leaky     the windows without cu_seqlens (linattn train before packing: states and predictions
            run across documents), for reference

The packed and leaky rows are the same random windows (with --cross K, the first K of them moved to
straddle a document start, so that the packed rows hold several documents); the padded rows other ones (documents from
their start). tokens/s counts real (non-padding) input tokens per second of a step (torch.utils.benchmark,
median of blocked_autorange); every mode is timed in each of R interleaved rounds and the ratio
packed / padded is formed within a round (median and range over rounds).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.utils.benchmark as tb

from linattn.training import data as D
from linattn.models import LinearTransformerLM, ModelConfig
from linattn.ops import native, packed as packed_ops
from linattn.training import packing as P
from linattn.training.tasks import LMTask


def _step_fn(model, opt, batch, mask=None, cu=None, in_kernels=True):
    task = LMTask(batch_size=1, seed=0)
    n_scored = max(1, int((batch.targets != D.IGNORE_INDEX).sum()))

    def step():
        packed_ops.IN_KERNELS = in_kernels
        opt.zero_grad(set_to_none=True)
        if cu is not None:
            loss, _ = task.loss_stats(model, batch)
        else:
            logits, _ = model(batch.inputs, mask)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                                                     ignore_index=D.IGNORE_INDEX, reduction="sum")
        (loss / n_scored).backward()
        opt.step()

    return step


def run(kind: str, seq_len: int, batch_size: int, rounds: int, min_run_time: float, corpus: D.Corpus,
        cross: int = 0) -> dict:
    starts = P.split_starts(corpus, "train")
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(corpus.train.numel() - seq_len, (batch_size,), generator=g)
    if cross:  # the first `cross` windows straddle a document start (a third of the row before it)
        inner = starts[(starts > seq_len) & (starts < corpus.train.numel() - seq_len)]
        windows[:cross] = inner[torch.randint(inner.numel(), (cross,), generator=g)] - seq_len // 3
    packed = P.pack_windows(corpus.train, windows, seq_len, starts)
    usable = starts[starts < corpus.train.numel() - seq_len]
    doc_rows = usable[torch.randint(usable.numel(), (batch_size,), generator=g)]
    padded, mask = P.padded_document_batch(corpus.train, doc_rows, seq_len, starts)
    leaky = D.TaskBatch(packed.inputs, corpus.train[windows[:, None] + torch.arange(1, seq_len + 1)].long(), 256)
    config = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_len=seq_len, attention=[kind])
    model = LinearTransformerLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fns = {"packed": _step_fn(model, opt, packed, cu=packed.cu_seqlens()),
           "per-length": _step_fn(model, opt, packed, cu=packed.cu_seqlens(), in_kernels=False),
           "padded": _step_fn(model, opt, padded, mask=mask),
           "leaky": _step_fn(model, opt, leaky)}
    real = {"packed": packed.inputs.numel(), "per-length": packed.inputs.numel(), "padded": int(mask.sum()),
            "leaky": leaky.inputs.numel()}
    for fn in fns.values():  # warm-up (and the fused kernels' first use)
        fn()
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(rounds):
        for mode, fn in fns.items():
            times[mode].append(tb.Timer("f()", globals={"f": fn}).blocked_autorange(min_run_time=min_run_time).median)
    packed_ops.IN_KERNELS = True
    ratios = [(real["packed"] / tp) / (real["padded"] / td) for tp, td in zip(times["packed"], times["padded"])]
    old = [(real["per-length"] / tp) / (real["padded"] / td) for tp, td in zip(times["per-length"], times["padded"])]
    return {"kind": kind, "T": seq_len, "B": batch_size, "docs": int(packed.starts.sum()),
            "padding": 1 - real["padded"] / (batch_size * seq_len),
            **{f"{m}_tok_s": real[m] / statistics.median(t) for m, t in times.items()},
            "ratio": statistics.median(ratios), "ratio_lo": min(ratios), "ratio_hi": max(ratios),
            "per_length_ratio": statistics.median(old), "per_length_lo": min(old), "per_length_hi": max(old)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="linear,gated_deltanet,softmax")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-run-time", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cross", type=int, default=0, help="windows made to straddle a document start")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    corpus = D.Corpus.load()
    print(f"{corpus.describe()}\nthreads {args.threads}, fused kernels {native.available()}, "
          f"torch {torch.__version__}")
    print(f"{'kind':<15}{'T':>6}{'B':>4}{'docs':>6}{'padding':>9}{'packed tok/s':>14}{'per-length':>12}"
          f"{'padded tok/s':>14}{'leaky tok/s':>13}{'packed/padded':>22}{'per-length/padded':>24}")
    for kind in args.kinds.split(","):
        for seq_len in args.seq_len:
            r = run(kind, seq_len, args.batch_size, args.rounds, args.min_run_time, corpus, args.cross)
            print(f"{r['kind']:<15}{r['T']:>6}{r['B']:>4}{r['docs']:>6}{r['padding']:>8.1%}{r['packed_tok_s']:>14,.0f}"
                  f"{r['per-length_tok_s']:>12,.0f}{r['padded_tok_s']:>14,.0f}{r['leaky_tok_s']:>13,.0f}"
                  f"{r['ratio']:>9.2f}× ({r['ratio_lo']:.2f}–{r['ratio_hi']:.2f})"
                  f"{r['per_length_ratio']:>11.2f}× ({r['per_length_lo']:.2f}–{r['per_length_hi']:.2f})", flush=True)


if __name__ == "__main__":
    main()
