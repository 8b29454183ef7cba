"""Seeds of the recall presets (linattn.eval.recall) aggregated: per (setting, kind, variant) the lr with
the best mean accuracy over seeds, mean ± sd with every seed's value and the worst seed, the runs
that never leave the plateau, and the literature's criteria judged on the means and on every seed.

A record is one run (linattn.eval.recall._run): kind, variant, seq_len, n_pairs, lr, seed, accuracy (None:
the run diverged, counted as 0), steps, steps_to_stop, curve [(step, accuracy)], state_size.

Plateau: MQAR models sit near 0 accuracy until they discover the induction mechanism, then jump
(Zoology §3; our curves jump between steps 200 and 700 at (64, 16)); a run whose best validation
accuracy stays below PLATEAU_ACCURACY never left that plateau, which is a different failure from a
run that learned part of the pairs (elu+1's ~0.5) and is marked as such.
"""

from __future__ import annotations

import math
import statistics

from ..models import KINDS
from ..models.kinds import label
from .kinds import MIXER_KINDS

__all__ = ["CRITERIA", "DELTA_KINDS", "LABELS", "RECALL_KINDS", "MIN_PAIRS", "PLATEAU_ACCURACY", "check_seed_criteria", "fmt_mean_sd",
           "on_plateau", "summarize_seeds"]

#: the kinds of the recall presets, in table order: softmax, the feature maps, every causal-only kind of
#: the kinds table, and a GLA/softmax hybrid
RECALL_KINDS = ("softmax", "elu", "favor", "cosformer", "taylor", "hedgehog", *MIXER_KINDS, "hybrid")
LABELS = {**{k: label(k) for k in RECALL_KINDS if k != "hybrid"}, "hybrid": "hybrid"}
#: the delta-rule kinds (Kind.family), of which the literature says they recall well (Yang et al. 2024)
DELTA_KINDS = tuple(k for k in MIXER_KINDS if KINDS[k].family == "delta")

#: (name, kinds, test, needs) of each criterion: test gets {kind: accuracy} of one setting (the means,
#: or one seed's values) and runs when all of its kinds ran (needs "all") or at least one ("any")
CRITERIA = (
    ("softmax ≥ 0.95", ("softmax",), lambda a: a["softmax"] >= 0.95, "all"),
    ("Taylor ≥ 0.90", ("taylor",), lambda a: a["taylor"] >= 0.90, "all"),
    *((f"{LABELS[k]} ≥ 0.90", (k,), lambda a, k=k: a[k] >= 0.90, "all") for k in DELTA_KINDS),
    *((f"{LABELS[k]} ≤ Taylor − 0.20", (k, "taylor"), lambda a, k=k: a[k] <= a["taylor"] - 0.20, "all")
      for k in ("elu", "favor", "cosformer")),
)
MIN_PAIRS = 8  # the criteria apply at settings with at least this many pairs
#: a run whose best validation accuracy stays below this never left the plateau
PLATEAU_ACCURACY = 0.05


def _acc(r: dict) -> float:
    return r["accuracy"] if r["accuracy"] is not None and math.isfinite(r["accuracy"]) else 0.0


def on_plateau(record: dict) -> bool:
    """True when the run's best validation accuracy (its curve and final accuracy) is below
    PLATEAU_ACCURACY: it never left the initial plateau."""
    accs = [a for _, a in record.get("curve") or [] if a is not None and math.isfinite(a)] + [_acc(record)]
    return max(accs) < PLATEAU_ACCURACY


def _sd(values: list) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def summarize_seeds(records: list) -> list[dict]:
    """One summary per (seq_len, n_pairs, kind, variant), in the records' first-seen order:

    {"seq_len", "n_pairs", "kind", "variant", "lr" (the lr with the highest mean over its seeds; ties:
    fewer mean steps, then the lower lr), "seeds", "accuracies" (per seed, that lr), "mean", "sd"
    (sample sd, None for one seed), "worst" (lowest accuracy), "worst_seed", "plateau_seeds" (seeds
    that never left the plateau), "steps" (per seed), "steps_to_stop" (per seed, None if never),
    "state_size" (mean over seeds, rounded), "lr_means" {lr: (mean, number of seeds)}}. A run that
    was interrupted before any validation (status "interrupted", accuracy None) was not run: it is
    left out (a diverged run counts as 0).
    """
    groups: dict = {}
    for r in records:
        if r.get("status") == "interrupted" and r.get("accuracy") is None:
            continue
        key = (r["seq_len"], r["n_pairs"], r["kind"], r.get("variant", ""))
        groups.setdefault(key, {}).setdefault(r["lr"], []).append(r)
    out = []
    for (n, p, kind, variant), by_lr in groups.items():
        def rank(item):
            lr, runs = item
            return (statistics.fmean(_acc(r) for r in runs), -statistics.fmean(r.get("steps") or 0 for r in runs), -lr)

        lr, runs = max(by_lr.items(), key=rank)
        runs = sorted(runs, key=lambda r: r.get("seed", 0))
        accs = [_acc(r) for r in runs]
        worst = min(range(len(runs)), key=lambda i: accs[i])
        out.append({"seq_len": n, "n_pairs": p, "kind": kind, "variant": variant, "lr": lr,
                    "seeds": [r.get("seed", 0) for r in runs], "accuracies": accs,
                    "mean": statistics.fmean(accs), "sd": _sd(accs), "worst": accs[worst],
                    "worst_seed": runs[worst].get("seed", 0),
                    "plateau_seeds": [r.get("seed", 0) for r in runs if on_plateau(r)],
                    "steps": [r.get("steps") for r in runs], "steps_to_stop": [r.get("steps_to_stop") for r in runs],
                    "state_size": round(statistics.fmean(r.get("state_size") or 0 for r in runs)),
                    "lr_means": {lr_: (statistics.fmean(_acc(r) for r in rs), len(rs)) for lr_, rs in by_lr.items()}})
    return out


def fmt_mean_sd(summary: dict) -> str:
    """'0.995 ± 0.002' (sd over seeds; no ± for one seed)."""
    sd = summary["sd"]
    return f"{summary['mean']:.3f}" + ("" if sd is None else f" ± {sd:.3f}")


def check_seed_criteria(summaries: list) -> list[dict]:
    """[{"setting": [seq_len, n_pairs], "check", "holds" (on the means: True / False / None when a kind
    was not run), "holds_every_seed" (True when it holds on every seed that all its kinds ran; None if
    none), "seeds_holding" ("k/n"), "detail"}] for every setting with at least MIN_PAIRS pairs. Only
    summaries with variant "" take part (the frontier's sizes are not one kind's claim). A comparison
    of two kinds at a setting where softmax's mean stays below PLATEAU_ACCURACY is not made (holds
    None, "not comparable"): the control never left the plateau, and every kind sits on it there."""
    out = []
    main = [s for s in summaries if s.get("variant", "") == ""]
    for n, p in sorted({(s["seq_len"], s["n_pairs"]) for s in main}):
        if p < MIN_PAIRS:
            continue
        here = {s["kind"]: s for s in main if (s["seq_len"], s["n_pairs"]) == (n, p)}
        means = {k: s["mean"] for k, s in here.items()}
        for name, kinds, test, needs in CRITERIA:
            present = [k for k in kinds if k in here]
            runs = len(present) == len(kinds) if needs == "all" else bool(present)
            holds = test(means) if runs else None
            every, counted = None, ""
            if runs:
                common = set.intersection(*(set(here[k]["seeds"]) for k in present))
                per_seed = [test({k: here[k]["accuracies"][here[k]["seeds"].index(sd)] for k in present})
                            for sd in sorted(common)]
                if per_seed:
                    every, counted = all(per_seed), f"{sum(per_seed)}/{len(per_seed)}"
            detail = "; ".join(f"{LABELS.get(k, k)} {fmt_mean_sd(here[k])} (worst seed {here[k]['worst_seed']}: "
                               f"{here[k]['worst']:.3f})" for k in present) or "not run"
            control = means.get("softmax")
            if runs and len(kinds) > 1 and control is not None and control < PLATEAU_ACCURACY:
                # the control never left the plateau: neither did these kinds, their difference is noise
                holds, every, counted = None, None, ""
                detail = (f"not comparable: softmax itself stays on the plateau here ({control:.3f}: the setting "
                          f"is beyond this model's step budget); measured: {detail}")
            out.append({"setting": [n, p], "check": name, "holds": holds, "holds_every_seed": every,
                        "seeds_holding": counted, "detail": detail})
    return out
