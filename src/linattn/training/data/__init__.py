"""Data for training and evaluation: a byte-level text corpus and synthetic tasks.

Byte-level language modelling
    :func:`load_corpus` / :class:`Corpus` read text files as raw bytes (vocabulary 256, no
    tokenizer). With no paths the corpus is the running interpreter's standard library source
    (see :func:`stdlib_files`). :class:`ByteLMBatches` samples random windows of a byte tensor as
    ``(inputs, targets)`` pairs, deterministically from a seed, and can save and restore its
    position so a resumed run sees exactly the batches an uninterrupted one would have.

Synthetic tasks (generated on the fly from a seed or a ``torch.Generator``)
    * :func:`copy_task` -- the copy task of the Linear Transformer paper (Katharopoulos et al.,
      "Transformers are RNNs", ICML 2020, §4.1), framed for a decoder-only model.
    * :func:`mqar_task` -- multi-query associative recall (Arora et al., "Zoology: Measuring and
      Improving Recall in Efficient Language Models", 2023), following Zoology's generator.
    * :func:`listops_task` -- ListOps (Nangia & Bowman, 2018) as used in the Long Range Arena
      (Tay et al., "Long Range Arena", ICLR 2021), following LRA's generator, scaled down.

    Sequence tasks return a :class:`TaskBatch` whose ``targets`` hold :data:`IGNORE_INDEX`
    (-100, PyTorch's cross-entropy default) wherever no loss/accuracy is counted;
    ListOps returns a :class:`ClassificationBatch`.

Randomness: every generator takes ``seed=`` (an int) or ``generator=`` (a CPU
``torch.Generator``, advanced in place, so successive calls give fresh data). With neither, the
global torch RNG is used, like ``torch.randint``. All tensors are created on the CPU; use
``batch.to(device)``.
"""


from .base import IGNORE_INDEX, ClassificationBatch, TaskBatch, mix_seed
from .corpus import ByteLMBatches, Corpus, corpus_files, eval_batches, load_corpus, stdlib_files
from .listops import (LISTOPS_CLS, LISTOPS_OPERATORS, LISTOPS_PAD, LISTOPS_TOKENS, listops_decode, listops_evaluate,
                      listops_expression, listops_task)
from .synthetic import MQAR_CONFIGS, copy_task, mqar_task

__all__ = [
    "IGNORE_INDEX",
    "MQAR_CONFIGS",
    "LISTOPS_TOKENS",
    "LISTOPS_OPERATORS",
    "LISTOPS_PAD",
    "LISTOPS_CLS",
    "Corpus",
    "ByteLMBatches",
    "TaskBatch",
    "ClassificationBatch",
    "stdlib_files",
    "corpus_files",
    "load_corpus",
    "eval_batches",
    "copy_task",
    "mqar_task",
    "listops_task",
    "listops_expression",
    "listops_decode",
    "listops_evaluate",
    "mix_seed",
]

