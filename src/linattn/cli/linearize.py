"""`linattn linearize`: a softmax teacher into a linear-attention model that decodes as an RNN.
Thin: options -> linattn.linearize (one run) or linattn.linearize.experiment (the preset).

    linattn linearize --teacher runs/teacher --recipe lolcats --out runs/lolcats
    linattn linearize --preset experiment --out docs/results/linearize-run     # teacher + 3 recipes × 3 seeds
"""

from __future__ import annotations

import sys

from .args import add_command, add_common_options, int_list, positive_float, positive_int


def add_parser(subparsers) -> None:
    from ..models.linearized import DEFAULT_RECIPE, RECIPES

    p = add_command(subparsers, "linearize", run_linearize_command,
                    help="convert a softmax Transformer into a linear-attention model (LoLCATs, Liger, T2R)",
                    description_tail="Recipes: " + "; ".join(f"{r.name} ({r.cite})" for r in RECIPES.values()) + ".")
    p.add_argument("--teacher", metavar="PATH", help="a linattn checkpoint or run folder with softmax layers")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=DEFAULT_RECIPE, help="default: %(default)s")
    p.add_argument("--layers", type=int_list, default=None, metavar="I[,I...]",
                   help="the softmax layers to linearize (default: all; the others stay softmax: a hybrid)")
    p.add_argument("--preset", choices=("experiment",), default=None,
                   help="experiment: train a softmax byte-LM teacher on the standard library (or reuse --out/teacher), "
                        "linearize it by every recipe with 3 seeds, write linearize.{md,json,png} to --out; resumable")
    p.add_argument("--seeds", type=int_list, default=None, metavar="S[,S...]",
                   help="--preset experiment: the seeds of every linearization (default: 0,1,2)")
    g = p.add_argument_group("stages")
    g.add_argument("--seq-len", type=positive_int, default=512)
    g.add_argument("--batch-size", type=positive_int, default=8)
    g.add_argument("--transfer-steps", type=positive_int, default=200, help="stage 1 steps (default: %(default)s)")
    g.add_argument("--transfer-lr", type=positive_float, default=1e-2)
    g.add_argument("--finetune-steps", type=positive_int, default=200, help="stage 2 steps (default: %(default)s)")
    g.add_argument("--finetune-lr", type=positive_float, default=None,
                   help="stage 2 (default: 3e-3 with LoRA, 1e-3 for full fine-tuning)")
    g.add_argument("--mode", choices=("lora", "full"), default=None, help="stage 2 (default: the recipe's)")
    g.add_argument("--lora-rank", type=positive_int, default=8)
    g.add_argument("--kl-weight", type=float, default=0.0, help="KL to the teacher's next-byte distribution")
    g.add_argument("--corpus", action="append", metavar="PATH", default=None,
                   help="file or folder of the byte corpus (repeatable; default: the Python standard library)")
    g.add_argument("--corpus-max-bytes", type=positive_int, default=None, metavar="N")
    g = p.add_argument_group("report")
    g.add_argument("--contexts", type=int_list, default=None, metavar="N[,N...]",
                   help="decode contexts for ms/token and cache bytes (default: 1024,4096; the preset: "
                        "1024,4096,8192,16384,32768)")
    g.add_argument("--no-decode", action="store_true",
                   help="--preset experiment: leave the decode timings for a later run on an idle machine")
    g.add_argument("--eval-batches", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=None, metavar="T", help="torch threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_options(p, dtype=False)


def run_linearize_command(args) -> int:
    """Keeps the teacher's embeddings, norms, MLPs and q/k/v/o weights and replaces its softmax layers by the
    recipe's kind: stage 1 trains the new parameters to reproduce each layer's softmax output (attention transfer),
    stage 2 fine-tunes with LoRA (peft) or every weight. Writes --out/stage1, stage2 (training runs: the same
    command again resumes them), model (the linearized linattn LM) and linearize.{json,md,png}: teacher, naive swap,
    stage 1 and stage 2 by bits per byte, a recall probe, decode ms/token and cache size by context."""
    import torch

    from ..linearize import LinearizeConfig, LinearizeInterrupted, linearize
    from ..linearize.report import report_table
    from ..report import make_console, output_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    console = make_console()
    try:
        if args.preset == "experiment":
            from ..linearize.experiment import run_experiment

            out = output_dir("linearize", args.out)
            run_experiment(out, seeds=args.seeds, console=console, progress=not args.quiet,
                           decode=not args.no_decode, **({"contexts": tuple(args.contexts)} if args.contexts else {}))
            return 0
        if not args.teacher:
            print("linattn linearize: error: --teacher PATH is required (or --preset experiment)", file=sys.stderr)
            return 2
        out = output_dir("linearize", args.out)
        cfg = LinearizeConfig(teacher=args.teacher, out=str(out), recipe=args.recipe, layers=args.layers,
                              seq_len=args.seq_len, batch_size=args.batch_size, transfer_steps=args.transfer_steps,
                              transfer_lr=args.transfer_lr, finetune_steps=args.finetune_steps,
                              finetune_lr=args.finetune_lr, mode=args.mode, lora_rank=args.lora_rank,
                              kl_weight=args.kl_weight, corpus=args.corpus, corpus_max_bytes=args.corpus_max_bytes,
                              seed=args.seed or 0, device=args.device or "cpu", eval_batches=args.eval_batches,
                              contexts=tuple(args.contexts or (1024, 4096)))
        report = linearize(cfg, progress=not args.quiet, console=console)
    except LinearizeInterrupted as exc:
        print(f"linattn linearize: interrupted: {exc}", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"linattn linearize: error: {exc}", file=sys.stderr)
        return 2
    console.print(report_table(report))
    console.print(f"report: {out.resolve()} (model/, linearize.md, linearize.json, linearize.png)")
    return 0
