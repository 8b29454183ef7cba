"""Issue 28: Gated DeltaNet gate statistics at step 0 of the recall preset, per seed."""
import dataclasses, sys, math
import torch
torch.set_num_threads(1)
from linattn.eval import recall

from linattn.nn.decay import ScalarDecay

for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    preset = recall.RECALL_PRESET
    (n, p, b), = preset.settings
    cfg = recall.recall_config(preset, "gated_deltanet", n, p, b, 1e-2, seed=seed)
    task = cfg._task
    task.load_data()
    model = task.build_model(cfg.model_config())
    gs = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: gs.append(out.detach())) for m in model.modules()
             if isinstance(m, ScalarDecay)]
    batch = task.train_batch(0)
    with torch.no_grad():
        task.loss_stats(model, batch) if hasattr(task, "loss_stats") else None
    parts = []
    for i, (m, g) in enumerate(zip([m for m in model.modules() if isinstance(m, ScalarDecay)], gs)):
        A = m.A_log.exp().item(); dt = torch.nn.functional.softplus(m.dt_bias).item()
        parts.append(f"L{i}: A={A:5.2f} dt={dt:.4f} A*dt={A*dt:.4f} g mean={g.mean():.4f} min={g.min():.4f} "
                     f"decay^64={math.exp(g.mean().item()*64):.3g}")
    print(f"seed {seed}: " + " | ".join(parts), flush=True)
