"""What a linearization kept of its teacher, measured the same way for the teacher and each stage:

    bpb          validation bits per byte on the held-out part of the corpus (training.tasks.evaluate)
    recall       an associative-recall probe on the teacher's own vocabulary (bytes): lines "key = V"
                 with distinct three-letter keys and one-letter values, then some of the keys again
                 ("key = "), scored on the value that follows (accuracy at those bytes; chance 1/26).
                 Recall of in-context pairs is what linear attention loses first (Zoology, Based).
    decode       the step `generate` takes (fused where every layer has a fused mixer, else eager):
                 ms/token and the decoding cache's bytes after a prefill of each context length —
                 flat for the linearized model, growing for the teacher's KV cache.
    recovered    (naive − stage) / (naive − teacher) of the bpb: the share of the gap between the naive
                 swap and the teacher that a stage closes (LoLCATs' and Liger's figure).
"""

from __future__ import annotations

import string

import torch

from ..models.decoding import FusedDecoder, fused_decoding_obstacle
from ..training.tasks import BytesTask, evaluate

__all__ = ["bpb", "decode_costs", "recall_accuracy", "recall_batch", "recovered"]


def bpb(model, *, seq_len: int, corpus=None, corpus_max_bytes=None, val_fraction: float = 0.05,
        eval_batches: int = 16, batch_size: int = 8, packing: bool = True) -> float:
    """Validation bits per byte of `model` on the corpus's held-out part (documents packed)."""
    task = BytesTask(seq_len=seq_len, batch_size=batch_size, seed=0, eval_batches=eval_batches, corpus=corpus,
                     corpus_max_bytes=corpus_max_bytes, val_fraction=val_fraction, packing=packing)
    return evaluate(model, task)["bpb"]


def recall_batch(n_examples: int = 64, n_pairs: int = 16, n_queries: int = 8, seed: int = 0):
    """(ids (B, N) long bytes, targets (B, N) long with -100 except at the queried values)."""
    g = torch.Generator().manual_seed(seed)
    letters, values = string.ascii_lowercase, string.ascii_uppercase
    rows, targets = [], []
    for _ in range(n_examples):
        keys: list[str] = []
        while len(keys) < n_pairs:
            key = "".join(letters[i] for i in torch.randint(0, 26, (3,), generator=g).tolist())
            if key not in keys:
                keys.append(key)
        vals = [values[i] for i in torch.randint(0, 26, (n_pairs,), generator=g).tolist()]
        text = "".join(f"{k} = {v}\n" for k, v in zip(keys, vals))
        asked = torch.randperm(n_pairs, generator=g)[:n_queries].tolist()
        marks = []
        for i in asked:
            text += f"{keys[i]} = "
            marks.append(len(text))
            text += f"{vals[i]}\n"
        ids = torch.tensor(list(text.encode()), dtype=torch.long)
        tgt = torch.full_like(ids, -100)
        for m in marks:
            tgt[m - 1] = ids[m]  # the logits at the space before the value predict the value
        rows.append(ids)
        targets.append(tgt)
    n = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, n - len(r)), value=ord("\n")) for r in rows])
    tgt = torch.stack([torch.nn.functional.pad(t, (0, n - len(t)), value=-100) for t in targets])
    return ids, tgt


@torch.no_grad()
def recall_accuracy(model, n_examples: int = 64, n_pairs: int = 16, n_queries: int = 8, seed: int = 0) -> float:
    """Accuracy of the argmax at the queried values of recall_batch (module docstring)."""
    ids, tgt = recall_batch(n_examples, n_pairs, n_queries, seed)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        logits, _ = model(ids.to(device))
    finally:
        model.train(was)
    keep = tgt != -100
    return float((logits.argmax(-1).cpu()[keep] == tgt[keep]).float().mean())


#: one-token steps timed per context (after STEPS_WARMUP untimed ones): the cache grows by their sum
STEPS_TIMED, STEPS_WARMUP = 200, 8


def _step_fn(model, ctx: int, seed: int):
    """(step(), cache bytes after the prefill, path) after a prefill of ctx random tokens: the step
    generate takes, the fused decoder's KV caches reserved for the timed steps."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=g)
    tok = torch.randint(0, model.config.vocab_size, (1,), generator=g)
    with torch.inference_mode():
        _, cache = model(ids, cache=model.new_cache(), last_only=True)
    nbytes = sum(cache.nbytes)
    if fused_decoding_obstacle(model) is None:
        decoder = FusedDecoder(model, cache, reserve=STEPS_TIMED + STEPS_WARMUP + 1)
        return (lambda: decoder.step(tok)), nbytes, "fused"

    def eager():
        with torch.inference_mode():
            return model(tok[:, None], cache=cache, last_only=True)

    return eager, nbytes, "eager"


def decode_costs(model, contexts, *, seed: int = 0) -> list[dict]:
    """[{context, ms_per_token, cache_bytes, path}]: the mean of STEPS_TIMED one-token steps
    (torch.utils.benchmark) after a prefill of each context length; the cache's bytes after the
    prefill (the steps add STEPS_TIMED + STEPS_WARMUP tokens, nothing against the contexts)."""
    from torch.utils import benchmark

    model.eval()
    out = []
    for ctx in contexts:
        if model.config.max_positions is not None and ctx + STEPS_TIMED + STEPS_WARMUP > model.config.max_positions:
            out.append({"context": ctx, "ms_per_token": None, "cache_bytes": None, "path": None,
                        "skipped": f"beyond the model's {model.config.max_positions} positions"})
            continue
        step, nbytes, path = _step_fn(model, ctx, seed)
        for _ in range(STEPS_WARMUP):
            step()
        t = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads())
        out.append({"context": ctx, "ms_per_token": t.timeit(STEPS_TIMED).mean * 1e3, "cache_bytes": nbytes,
                    "path": path})
    return out


def recovered(naive: float, stage: float, teacher: float) -> float | None:
    """(naive − stage) / (naive − teacher): the share of the naive swap's bpb gap a stage closes
    (None when the naive swap is no worse than the teacher)."""
    gap = naive - teacher
    return None if gap <= 0 else (naive - stage) / gap
