"""A softmax Transformer turned into a linear-attention model that decodes as an RNN (design §19):
the recipes, and the student built from a teacher with the teacher's weights.

A recipe says what each linearized softmax layer becomes and how it is trained (linattn.linearize
runs the stages):

    lolcats   LoLCATs (Zhang et al. 2024): a 64-token softmax window plus linear attention with
              learned Hedgehog feature maps, one normalizer (kind `lolcats`); stage 1 trains the maps
              and the window factors by attention transfer, stage 2 LoRA (rank 8 on q, k, v, o)
    liger     Liger (Lan et al. 2025): the teacher's own q, k, v, o as a gated recurrence whose gates
              come from the keys, plus a 64-token window (kind `liger`); no new parameter, so no
              stage 1; stage 2 LoRA
    t2r       T2R (Kasai et al. 2021): linear attention with a learned ReLU feature map (kind
              `linear`, feature map `t2r`, 32 features); stage 1 trains the map, stage 2 fine-tunes
              every weight

The student keeps the teacher's embeddings, norms, MLPs and q/k/v/o projections (the names of the
state dict are the same for every kind: `qkv`, `out`, …): `student_from_teacher` copies them and
returns the names of the parameters the teacher does not have (the recipe's new ones). Layers not
linearized stay softmax, which gives a hybrid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .lm import LinearTransformerLM

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Recipe", "linearized_layers", "student_config", "student_from_teacher"]


@dataclass(frozen=True)
class Recipe:
    """name; kind: the student's kind for every linearized layer; model: ModelConfig fields the
    student changes (a feature map); kind_options: {kind: options}; transfer: stage 1 (attention
    transfer of the new parameters) runs; finetune: stage 2's mode, "lora" or "full"; cite: the
    paper."""

    name: str
    kind: str
    cite: str
    model: dict = field(default_factory=dict)
    kind_options: dict = field(default_factory=dict)
    transfer: bool = True
    finetune: str = "lora"


RECIPES = {r.name: r for r in (
    Recipe("lolcats", "lolcats", "Zhang et al. 2024, LoLCATs",
           kind_options={"lolcats": {"window": 64, "feature_map": "hedgehog"}}),
    Recipe("liger", "liger", "Lan et al. 2025, Liger", kind_options={"liger": {"window": 64}}, transfer=False),
    Recipe("t2r", "linear", "Kasai et al. 2021, T2R", model={"feature_map": "t2r",
                                                              "feature_map_options": {"num_features": 32}},
           finetune="full"),
)}


#: the recipe taken when none is named: LoLCATs
DEFAULT_RECIPE = next(iter(RECIPES))


def _recipe(recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


def linearized_layers(teacher: ModelConfig, layers=None) -> list[int]:
    """The layer indices to linearize: `layers` (each a softmax layer of the teacher), or every
    softmax layer (None). ValueError naming `layers` otherwise."""
    kinds = teacher.layer_kinds
    softmax = [i for i, k in enumerate(kinds) if k == "softmax"]
    if not softmax:
        raise ValueError("teacher: no softmax layer to linearize (its layers are " + ", ".join(sorted(set(kinds))) + ")")
    if layers is None:
        return softmax
    layers = sorted(set(int(i) for i in layers))
    bad = [i for i in layers if i not in softmax]
    if bad or not layers:
        raise ValueError(f"layers: {bad or layers} are not softmax layers of the teacher (its softmax layers: {softmax})")
    return layers


def student_config(teacher: ModelConfig, recipe, layers=None) -> ModelConfig:
    """The teacher's config with `layers` (default every softmax layer) of the recipe's kind."""
    r = _recipe(recipe)
    chosen = set(linearized_layers(teacher, layers))
    if teacher.block != "transformer":
        raise ValueError(f"teacher: block {teacher.block!r} is not linearized (only 'transformer' blocks)")
    kinds = [r.kind if i in chosen else k for i, k in enumerate(teacher.layer_kinds)]
    d = teacher.to_dict()
    d.update(r.model, attention=kinds)
    # the teacher's softmax layers took no short convolution or output gate: neither do the students'
    d["short_conv"], d["output_gate"] = 0, False
    d["kind_options"] = {**teacher.kind_options, **r.kind_options}
    return ModelConfig.from_dict(d)


def student_from_teacher(teacher: LinearTransformerLM, recipe, layers=None) -> tuple[LinearTransformerLM, list[str]]:
    """(student, new parameter names): the student of `recipe` with every weight the teacher has
    copied from it (the naive swap before any training); the new names are the recipe's own
    parameters (feature maps, window factors), at their initialization."""
    if not isinstance(teacher, LinearTransformerLM):
        raise TypeError(f"teacher must be a LinearTransformerLM, got {type(teacher).__name__}")
    cfg = student_config(teacher.config, recipe, layers)
    ref = next(teacher.parameters())
    student = LinearTransformerLM(dataclasses.replace(cfg)).to(device=ref.device, dtype=ref.dtype)
    theirs = teacher.state_dict()
    mine = student.state_dict()
    unexpected = sorted(set(theirs) - set(mine))
    shapes = sorted(k for k in theirs if k in mine and theirs[k].shape != mine[k].shape)
    if unexpected or shapes:
        raise ValueError(f"teacher weights that the student has no place for: {unexpected + shapes}")
    with torch.no_grad():
        for k, t in theirs.items():
            mine[k].copy_(t)
    new = [n for n, _ in student.named_parameters() if n not in theirs]
    return student, new
