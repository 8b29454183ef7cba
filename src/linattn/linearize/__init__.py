"""`linattn linearize`: convert a pretrained softmax Transformer into a linear-attention model that
decodes as an RNN — attention transfer, then low-rank (or full) fine-tuning — and report how much of
the teacher survives (design §19).

    from linattn.linearize import LinearizeConfig, linearize
    report = linearize(LinearizeConfig(teacher="runs/teacher", recipe="lolcats", out="runs/lolcats"))
    student = linattn.LinearTransformerLM.from_pretrained("runs/lolcats/model")

Recipes (linattn.models.linearized.RECIPES): lolcats, liger, t2r. The stages are training runs
(linattn.training.linearize's tasks); `linearize.evaluate` measures the teacher and each stage.
"""

from ..models.linearized import RECIPES, Recipe
from .run import LinearizeConfig, LinearizeInterrupted, evaluate_models, linearize

__all__ = ["LinearizeConfig", "LinearizeInterrupted", "RECIPES", "Recipe", "evaluate_models", "linearize"]
