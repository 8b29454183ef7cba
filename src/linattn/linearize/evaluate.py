"""What a linearization kept of its teacher, measured the same way for the teacher and each stage:

    bpb          validation bits per byte on the held-out part of the corpus (training.tasks.evaluate)
    recall       a copy probe on the teacher's own vocabulary (bytes): held-out snippets of 192 bytes,
                 each written twice; the accuracy on the second copy less that on the first is what
                 the model retrieves from its context (a softmax teacher copies; a linear student must carry the snippet in
                 its state beyond any window). Recall of the context is what linear attention loses
                 first (Zoology, Based). (A zero-shot `key = value` probe was tried first: the byte
                 teacher of the experiment scored 2% on it, no better than its students.)
    decode       the step `generate` takes (fused where every layer has a fused mixer, else eager):
                 ms/token and the decoding cache's bytes after a prefill of each context length —
                 flat for the linearized model, growing for the teacher's KV cache.
    recovered    (naive − stage) / (naive − teacher) of the bpb: the share of the gap between the naive
                 swap and the teacher that a stage closes (LoLCATs' and Liger's figure).
"""

from __future__ import annotations

import torch

from ..models.decoding import fused_decoding_obstacle
from ..models.session import DecodingSession
from ..training.tasks import BytesTask, evaluate

__all__ = ["bpb", "decode_costs", "recall_accuracy", "recall_batch", "recovered"]


def bpb(model, *, seq_len: int, corpus=None, corpus_max_bytes=None, val_fraction: float = 0.05,
        eval_batches: int = 16, batch_size: int = 8, packing: bool = True) -> float:
    """Validation bits per byte of `model` on the corpus's held-out part (documents packed)."""
    task = BytesTask(seq_len=seq_len, batch_size=batch_size, seed=0, eval_batches=eval_batches, corpus=corpus,
                     corpus_max_bytes=corpus_max_bytes, val_fraction=val_fraction, packing=packing)
    return evaluate(model, task)["bpb"]


def recall_batch(corpus=None, corpus_max_bytes=None, n_examples: int = 64, length: int = 192, seed: int = 0):
    """(ids (B, 2L + 1) long bytes, targets with -100 except on the second copy): `n_examples`
    snippets of `length` bytes from the held-out part of the corpus, each written twice, separated by
    a newline; the second copy is scored."""
    from ..training.tasks import _corpus

    val = _corpus(corpus, corpus_max_bytes, 0.05).validation
    if len(val) < length + 1:
        raise ValueError(f"the held-out corpus has {len(val)} bytes, fewer than a probe snippet of {length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(val) - length, (n_examples,), generator=g).tolist()
    snippet = torch.stack([torch.as_tensor(val[s:s + length]).long() for s in starts])
    nl = torch.full((n_examples, 1), ord("\n"), dtype=torch.long)
    ids = torch.cat([snippet, nl, snippet], 1)
    tgt = torch.full_like(ids, -100)
    tgt[:, length:-1] = ids[:, length + 1:]  # the logits at position t predict byte t + 1: the second copy
    return ids, tgt


@torch.no_grad()
def recall_accuracy(model, corpus=None, corpus_max_bytes=None, n_examples: int = 64, length: int = 192,
                    seed: int = 0) -> dict:
    """{"second": accuracy of the argmax on the second copy of held-out snippets (recall_batch),
    "first": on the first copy (no help from the context), "gain": second − first}: the gain is
    what the model retrieves from its context (a softmax model with induction heads copies; a fixed
    state must carry the snippet beyond any window)."""
    ids, _ = recall_batch(corpus, corpus_max_bytes, n_examples, length, seed)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        pred = model(ids.to(device))[0].argmax(-1).cpu()
    finally:
        model.train(was)
    first = float((pred[:, :length - 1] == ids[:, 1:length]).float().mean())
    second = float((pred[:, length:-1] == ids[:, length + 1:]).float().mean())
    return {"first": first, "second": second, "gain": second - first}


#: one-token steps timed per context (after STEPS_WARMUP untimed ones): the cache grows by their sum
STEPS_TIMED, STEPS_WARMUP = 200, 8


def _step_fn(model, ctx: int, seed: int):
    """(step(), cache bytes after the prefill, path) after a prefill of ctx random tokens: the step
    generate takes (its DecodingSession), the fused decoder's KV caches reserved for the timed steps."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=g)
    tok = torch.randint(0, model.config.vocab_size, (1,), generator=g)
    session = DecodingSession(model)
    with torch.inference_mode():
        session.forward(ids)
    session.reserve(STEPS_TIMED + STEPS_WARMUP + 1)

    def step():
        with torch.inference_mode():
            return session.step(tok)

    return step, sum(session.cache.nbytes), "fused" if fused_decoding_obstacle(model) is None else "eager"


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
