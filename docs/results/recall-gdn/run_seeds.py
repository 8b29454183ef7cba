# As run in issue 28 (before the seeds API: RecallPreset had one `seed`; today use
# recall.recall_config(..., seed=seed) or `linattn eval --preset recall --seeds ...`).
"""Background runner (issue 28): recall preset runs at lr 1e-2 for the key kinds, per seed, one thread,
appended to a jsonl (one record per finished run, with its seed). Skips runs already in the jsonl."""
import dataclasses, json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from linattn.eval import recall

out = Path(sys.argv[1])
order = [(k, s) for k, seeds in [("gated_deltanet", (0, 1, 2)), ("deltanet", (1, 2)), ("softmax", (1, 2)),
                                  ("elu", (1, 2)), ("taylor", (1, 2)), ("deltanet", (0,)), ("softmax", (0,)),
                                  ("elu", (0,)), ("taylor", (0,))] for s in seeds]
done = set()
if out.exists():
    for line in out.read_text().splitlines():
        r = json.loads(line)
        done.add((r["kind"], r["seed"], r["lr"]))
for kind, seed in order:
    lr = 1e-2
    if (kind, seed, lr) in done:
        continue
    preset = dataclasses.replace(recall.RECALL_PRESET, seed=seed)
    (n, p, b), = preset.settings
    cfg = recall.recall_config(preset, kind, n, p, b, lr)
    rec = recall._run(kind, n, p, lr, cfg)
    rec["seed"] = seed
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(kind, seed, rec["accuracy"], rec["steps"], round(rec["cpu_s"]), flush=True)
