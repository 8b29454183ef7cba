"""Issue 28: Gated DeltaNet at (64, 16), lr 1e-2, the recall preset's config, seed S, 500 of its 1,200
steps, with the gate (A, dt) of one layer optionally replaced after init; logs loss, validation
accuracy and per-layer A, dt = softplus(dt_bias), A*dt (the forgetting rate at x = 0) as it trains.
usage: diag_train.py SEED [LAYER A DT] [--steps N] [--kind K]"""
import json, math, sys
import torch
torch.set_num_threads(1)
import torch.nn.functional as F
from linattn.eval import recall
from linattn.nn.decay import ScalarDecay
from linattn.training import tasks as T
from linattn.training import train

args = sys.argv[1:]
stop = 500
if "--steps" in args:
    i = args.index("--steps"); stop = int(args[i + 1]); del args[i:i + 2]
kind = "gated_deltanet"
if "--kind" in args:
    i = args.index("--kind"); kind = args[i + 1]; del args[i:i + 2]
seed = int(args[0])
override = [(int(args[i]), float(args[i + 1]), float(args[i + 2])) for i in range(1, len(args), 3)]
orig = T.MqarTask.build_model

def build(self, config):
    m = orig(self, config)
    for layer, a, dt in override:
        d = [x for x in m.modules() if isinstance(x, ScalarDecay)][layer]
        with torch.no_grad():
            d.A_log.fill_(math.log(a))
            d.dt_bias.fill_(dt + math.log(-math.expm1(-dt)))
    return m

T.MqarTask.build_model = build
cfg = recall.recall_config(recall.RECALL_PRESET, kind, 64, 16, 64, 1e-2, seed=seed)
log = []

def gates(model):
    return [(round(d.A_log.exp().item(), 3), round(F.softplus(d.dt_bias).item(), 5),
             round(d.A_log.exp().item() * F.softplus(d.dt_bias).item(), 4))
            for d in model.modules() if isinstance(d, ScalarDecay)]

def cb(info):
    if info.step % 50 == 0 or info.step <= 1:
        row = {"step": info.step, "loss": round(info.loss, 4), "lr": info.lr, "grad_norm": round(info.grad_norm, 3),
               "gates": gates(info.model)}
        if info.validation:
            row["acc"] = info.validation["accuracy"]
        print(json.dumps(row), flush=True)
    if info.step >= stop:
        raise KeyboardInterrupt

res = train(cfg, progress=False, callback=cb)
print(json.dumps({"seed": seed, "override": override, "curve": [(v["step"], v["accuracy"]) for v in res.validation],
                  "status": res.status}), flush=True)
