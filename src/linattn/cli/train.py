"""`linattn train`: train a model from a config file and/or flags. Thin: options -> linattn.training.

    linattn train --config configs/train_bytes.toml --out runs/bytes
    linattn train --config configs/train_bytes.toml --out runs/bytes --resume       # continue
    torchrun --nproc-per-node 2 -m linattn.cli train --config ... --out ...          # data-parallel
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import add_command, add_common_options, positive_float, positive_int


def _nonneg_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def _set_arg(value: str) -> tuple[str, object]:
    """KEY=VALUE with KEY a TrainConfig field or model.FIELD / task_options.FIELD; VALUE JSON or a string."""
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. model.dropout=0.1), got {value!r}")
    key, raw = value.split("=", 1)
    key = key.strip()
    try:
        val = json.loads(raw)
    except json.JSONDecodeError:
        val = raw
    return key, val


# the flags that set a TrainConfig field / a ModelConfig field of the same name (None: not given,
# the config keeps its value)
_FIELDS = ("task", "steps", "batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
           "grad_clip", "seq_len", "corpus", "corpus_max_bytes", "eval_interval", "eval_batches", "eval_samples",
           "log_interval", "checkpoint_interval", "keep_checkpoints", "distributed", "backend", "sequence_parallel",
           "device", "dtype", "seed", "activation_checkpointing")
_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "attention", "feature_map", "qk_dim", "dropout")


def add_parser(subparsers) -> None:
    from ..training import DISTRIBUTED, TASKS

    p = add_command(subparsers, "train", run_train_command,
                    help="train a linear-attention model (byte-level LM or a synthetic task)",
                    epilog="examples: linattn train --config configs/train_bytes.toml --out runs/bytes | "
                           "linattn train --out runs/bytes --resume | "
                           "torchrun --nproc-per-node 2 -m linattn.cli train --config configs/train_bytes.toml "
                           "--out runs/ddp")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON config file (see configs/)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue a run: without PATH from --out's latest checkpoint; PATH may be a run folder or a "
                        "checkpoint folder; 'auto' resumes if a checkpoint exists, else starts fresh")
    g = p.add_argument_group("task and data")
    g.add_argument("--task", choices=TASKS, default=None, help="what to train on (default: bytes)")
    g.add_argument("--corpus", action="append", metavar="PATH", default=None,
                   help="file or folder of the byte corpus (repeatable; default: the Python standard library)")
    g.add_argument("--corpus-max-bytes", type=positive_int, metavar="N", default=None, help="read at most N bytes")
    g.add_argument("--seq-len", type=positive_int, metavar="N", default=None, help="byte-LM window length")
    g = p.add_argument_group("model (fields of ModelConfig; --set model.FIELD=VALUE for the others)")
    g.add_argument("--d-model", type=positive_int, default=None)
    g.add_argument("--n-layers", type=positive_int, default=None)
    g.add_argument("--n-heads", type=positive_int, default=None)
    g.add_argument("--attention", default=None, metavar="PATTERN",
                   help="layer kinds, e.g. linear or linear,linear,linear,softmax (repeated over the layers)")
    g.add_argument("--feature-map", default=None, metavar="NAME",
                   help="elu, relu, favor, trig, cosformer, taylor, hedgehog")
    g.add_argument("--qk-dim", type=positive_int, default=None, help="per-head query/key dim (e.g. 16 for taylor)")
    g.add_argument("--dropout", type=float, default=None)
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=positive_int, default=None, help="optimizer steps in total")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                   help="global batch in sequences (over all processes and accumulation steps)")
    g.add_argument("--grad-accum", type=positive_int, default=None, metavar="A", help="micro-steps per optimizer step")
    g.add_argument("--lr", type=positive_float, default=None, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=None, help="final lr / peak lr of the cosine decay")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--grad-clip", type=float, default=None, help="max gradient norm (0: off)")
    g.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute block activations in the backward (less memory, more time)")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-interval", type=_nonneg_int, default=None, help="validate every N steps (0: at the end)")
    g.add_argument("--eval-batches", type=positive_int, default=None, help="validation batches (byte LM)")
    g.add_argument("--eval-samples", type=positive_int, default=None, help="validation set size (synthetic tasks)")
    g.add_argument("--log-interval", type=positive_int, default=None, help="metrics.jsonl record every N steps")
    g.add_argument("--checkpoint-interval", type=_nonneg_int, default=None,
                   help="checkpoint every N steps (0: only at the end and on Ctrl-C)")
    g.add_argument("--keep-checkpoints", type=positive_int, default=None, help="step folders to keep")
    g.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    g = p.add_argument_group("parallelism")
    g.add_argument("--distributed", choices=DISTRIBUTED, default=None,
                   help="auto: DDP when launched by torchrun with several processes (default); on; off")
    g.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--sequence-parallel", type=positive_int, default=None, metavar="P",
                   help="processes per sequence: each sequence is split into P contiguous shards that run sequence-parallel "
                        "(LM tasks; under torchrun, whose process count must be a multiple of P; the rest is data "
                        "parallelism)")
    p.add_argument("--set", dest="overrides", type=_set_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="any other field: e.g. --set model.dropout=0.1 --set task_options.n_pairs=8 "
                        "(VALUE is parsed as JSON, else taken as a string)")
    add_common_options(p)
    p.set_defaults(device=None, dtype=None, seed=None)


def _config_fields(args) -> dict:
    """The TrainConfig fields of the command: --config (or, when resuming without one, the
    checkpoint's), then the flags."""
    from ..training import TrainConfig, find_checkpoint, load_config_file, read_trainer_doc

    if args.config:
        base = load_config_file(args.config)
    elif args.resume not in (None, "auto"):
        where = args.resume if args.resume != "latest" else args.out
        if where is None:
            raise ValueError("--resume without a PATH needs --out RUN_DIR (the run to continue)")
        try:
            ckpt = find_checkpoint(where)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"nothing to resume in {where}: {exc}") from None
        base = dict(read_trainer_doc(ckpt)["train_config"])
        for key in ("resume", "out_dir"):
            base.pop(key, None)
    else:
        base = {}
    base = dict(base)
    if "model" in base:
        model = dict(base["model"])
    else:  # flags refine the default model rather than ModelConfig's bare defaults
        from dataclasses import fields

        model = dict(next(f for f in fields(TrainConfig) if f.name == "model").default_factory())
    task_options = dict(base.get("task_options", {}))
    for name in _FIELDS:
        if getattr(args, name, None) is not None:
            base[name] = getattr(args, name)
    for name in _MODEL_FIELDS:
        if getattr(args, name, None) is not None:
            model[name] = getattr(args, name)
    for key, val in args.overrides:
        if key.startswith("model."):
            model[key[len("model."):]] = val
        elif key.startswith("task_options."):
            task_options[key[len("task_options."):]] = val
        else:
            base[key] = val
    base["model"] = model
    if task_options or "task_options" in base:
        base["task_options"] = task_options
    if args.resume is not None:
        base["resume"] = args.resume
    return base


def run_train_command(args) -> int:
    """Trains a model: AdamW, warm-up + cosine schedule, gradient clipping and accumulation, optional bf16 autocast
    and activation checkpointing. Settings come from --config (TOML or JSON; keys are TrainConfig fields, with
    [model] and [task_options] tables) and are overridden by flags. Writes metrics.jsonl, loss.png,
    train_config.json and checkpoints/ (step-N folders, `last` -> latest) to --out. Ctrl-C saves a checkpoint and
    exits 130; a non-finite loss stops with exit 3. Under torchrun (WORLD_SIZE > 1) the run is data-parallel (DDP;
    gloo on CPU, NCCL on GPU)."""
    from ..models.checkpoint import CheckpointError
    from ..parallel.comm import SequenceParallelError
    from ..report import output_dir
    from ..training import TrainConfig, train

    try:
        fields = _config_fields(args)
        if args.out is not None:
            fields["out_dir"] = args.out
        cfg = TrainConfig.from_dict(fields)
        if cfg.out_dir is None and cfg.resume in (None, "auto", "latest"):
            if cfg.resume == "latest":
                raise ValueError("--resume without a PATH needs --out RUN_DIR (the run to continue)")
            if int(os.environ.get("RANK", "0")) == 0:  # other ranks write nothing: no folder for them
                cfg.out_dir = str(output_dir("train", None))  # a path only: the validated config stays valid
        result = train(cfg, progress=not args.quiet)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        print(f"linattn train: error: {exc}", file=sys.stderr)
        return 2
    except SequenceParallelError as exc:  # a peer died or froze: one line, not the backend's traceback
        first = (str(exc).strip().splitlines() or ["sequence parallelism failed"])[0]
        print(f"linattn train: error: {first}", file=sys.stderr)
        return 1
    if result.rank == 0:
        if args.quiet and result.status != "completed":
            print(result.message, file=sys.stderr)
        elif not args.quiet and result.out_dir is not None:
            print(f"run folder: {result.out_dir.resolve()} (metrics.jsonl, loss.png, checkpoints/last)")
    return result.exit_code
