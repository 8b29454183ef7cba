"""linattn linearize (issue 35): the student built from a teacher, the two stages as training tasks,
LoRA merged back, exact resume, decoding, the report and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from linattn import LinearTransformerLM, ModelConfig
from linattn.cli import main
from linattn.linearize import LinearizeConfig, linearize
from linattn.models.linearized import RECIPES, student_config, student_from_teacher
from linattn.training import TrainConfig, train
from linattn.training.linearize import add_lora, merge_lora

pytest.importorskip("peft")

CORPUS = 200_000  # bytes of the standard library the tiny runs read


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def tiny_teacher(seed=0, **over) -> LinearTransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, attention="softmax", positions="rope",
                      seed=seed, **over)
    return LinearTransformerLM(cfg)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    torch.set_num_threads(1)
    train(TrainConfig(task="bytes", model={"d_model": 32, "n_layers": 2, "n_heads": 2, "attention": "softmax",
                                           "positions": "rope"}, seq_len=96, batch_size=8, steps=25, lr=3e-3,
                      warmup_steps=3, corpus_max_bytes=CORPUS, eval_interval=0, out_dir=str(out)), progress=False)
    return out


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_student_keeps_every_teacher_weight(recipe):
    teacher = tiny_teacher()
    student, new = student_from_teacher(teacher, recipe)
    theirs, mine = teacher.state_dict(), student.state_dict()
    assert set(theirs) <= set(mine)
    for k, t in theirs.items():
        assert torch.equal(mine[k], t), k
    assert set(new) == set(mine) - set(theirs) - {k for k in mine if not k.endswith(("weight", "bias", "logit"))}
    assert bool(new) == RECIPES[recipe].transfer
    assert student.config.layer_kinds == [RECIPES[recipe].kind] * 2


def test_lolcats_within_its_window_is_the_teacher():
    """Up to W tokens LoLCATs' window covers every key and its linear part is empty: the naive swap's
    logits are the teacher's, which checks the mapping of q/k/v/o, norms, MLPs and RoPE."""
    teacher = tiny_teacher().double()
    student, _ = student_from_teacher(teacher, "lolcats")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(student.double()(ids)[0], teacher(ids)[0], atol=1e-10, rtol=1e-10)
    longer = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(student(longer)[0], teacher(longer)[0], atol=1e-6)  # beyond W it is linear


def test_a_hybrid_keeps_the_layers_not_linearized():
    teacher = tiny_teacher()
    student, new = student_from_teacher(teacher, "liger", layers=[1])
    assert student.config.layer_kinds == ["softmax", "liger"]
    with pytest.raises(ValueError, match="layers"):
        student_config(teacher.config, "liger", layers=[2])
    lin = LinearTransformerLM(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, attention="linear"))
    with pytest.raises(ValueError, match="no softmax layer"):
        student_from_teacher(lin, "lolcats")
    with pytest.raises(ValueError, match="recipe"):
        student_config(teacher.config, "mamba")


def test_attention_transfer_loss_is_the_layerwise_mse(teacher_dir):
    cfg = TrainConfig(task="attention-transfer", model={}, task_options={"teacher": str(teacher_dir), "recipe": "t2r"},
                      seq_len=96, batch_size=4, steps=1, corpus_max_bytes=CORPUS, packing=False)
    task = cfg._task
    student = task.build_model(cfg.model_config())
    assert {n for n, p in student.named_parameters() if p.requires_grad} == {
        f"blocks.{i}.attn.feature_map.{w}" for i in (0, 1) for w in ("weight", "bias")}
    batch = task.train_batch(0)
    loss, _ = task.loss_stats(student, batch)
    teacher, x = task.teacher, batch.inputs
    h = teacher.tok_emb(x)
    expected = 0.0
    for block, sblock in zip(teacher.blocks, student.blocks):
        a = block.norm1(h)
        expected += (sblock.attn(a)[0] - block.attn(a)[0]).square().mean(-1).sum()
        h = block(h)[0]
    torch.testing.assert_close(loss, expected.float(), rtol=1e-4, atol=1e-6)


def _before_after(cfg: TrainConfig, res) -> tuple[float, float]:
    """The stage's validation loss of its initial model and of the trained one (same fixed batches)."""
    from linattn.training.tasks import evaluate

    task = cfg._task
    return evaluate(task.build_model(cfg.model_config()), task)["loss"], res.final["loss"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_lowers_its_stage_losses(teacher_dir, tmp_path, recipe):
    common = dict(model={}, seq_len=96, batch_size=8, corpus_max_bytes=CORPUS, eval_interval=0, eval_batches=4,
                  warmup_steps=2, min_lr_ratio=1.0, weight_decay=0.0)
    opts = {"teacher": str(teacher_dir), "recipe": recipe}
    if RECIPES[recipe].transfer:
        c1 = TrainConfig(task="attention-transfer", task_options=opts, steps=20, lr=1e-2, out_dir=str(tmp_path / "s1"),
                         **common)
        before, after = _before_after(c1, train(c1, progress=False))
        assert after < 0.9 * before, (recipe, before, after)
        opts = {**opts, "student": str(tmp_path / "s1")}
    c2 = TrainConfig(task="linearized-finetune", task_options=opts, steps=20, lr=3e-3, out_dir=str(tmp_path / "s2"),
                     **common)
    s2 = train(c2, progress=False)
    before, after = _before_after(c2, s2)
    assert after < before, (recipe, before, after)
    trained = {n for n, p in s2.model.named_parameters() if p.requires_grad}
    if RECIPES[recipe].finetune == "lora":
        assert trained and all("lora_" in n for n in trained)
    else:
        assert trained == {n for n, _ in s2.model.named_parameters()}


def test_lora_merges_back_losslessly():
    student, _ = student_from_teacher(tiny_teacher().double(), "liger")
    add_lora(student, rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in student.named_parameters():
            if "lora_B" in n:  # peft starts B at 0: make the adapters do something
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    ids = torch.randint(0, 256, (2, 20), generator=gen)
    with_adapters = student(ids)[0]
    merged = merge_lora(student)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    plain = LinearTransformerLM(merged.config).double()
    plain.load_state_dict(merged.state_dict())  # a plain linattn model holds the merged weights
    torch.testing.assert_close(plain(ids)[0], with_adapters, atol=1e-10, rtol=1e-10)


def test_finetune_resumes_exactly(teacher_dir, tmp_path):
    def cfg(out, steps=6):
        return TrainConfig(task="linearized-finetune", model={}, task_options={"teacher": str(teacher_dir),
                                                                                "recipe": "liger", "kl_weight": 0.5},
                           seq_len=64, batch_size=4, steps=steps, lr=3e-3, warmup_steps=1, corpus_max_bytes=CORPUS,
                           eval_interval=0, out_dir=str(out), resume="auto")

    whole = train(cfg(tmp_path / "a"), progress=False)

    def stop_at_3(info):
        if info.step == 3:
            raise KeyboardInterrupt

    cut = train(cfg(tmp_path / "b"), progress=False, callback=stop_at_3)
    assert cut.status == "interrupted" and cut.step == 3
    resumed = train(cfg(tmp_path / "b"), progress=False)
    assert resumed.status == "completed" and resumed.losses == whole.losses[3:]
    for (n, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_linearize_writes_a_model_that_decodes_as_an_rnn_and_a_report(teacher_dir, tmp_path):
    out = tmp_path / "t2r"
    report = linearize(LinearizeConfig(teacher=str(teacher_dir), out=str(out), recipe="t2r", seq_len=96,
                                       transfer_steps=4, finetune_steps=4, corpus_max_bytes=CORPUS, eval_batches=2,
                                       contexts=(100,), recall=4), progress=False)
    assert [r["model"] for r in report["rows"]] == ["teacher", "naive swap", "stage 1", "stage 2"]
    assert all(r["bpb"] > 0 and 0 <= r["recall"] <= 1 for r in report["rows"])
    model = LinearTransformerLM.from_pretrained(out / "model").double().eval()
    assert model.config.layer_kinds == ["linear", "linear"] and model.config.feature_map == "t2r"
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    full = model(ids)[0]
    cache, steps = model.new_cache(), []
    for t in range(12):
        logits, cache = model(ids[:, t:t + 1], cache=cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=1e-10)
    dec = report["decode"]
    assert dec["teacher"][0]["cache_bytes"] > dec["stage 2"][0]["cache_bytes"] > 0
    for name in ("linearize.json", "linearize.md", "linearize.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "linearize.json").read_text())["recipe"]["name"] == "t2r"
    # the same call again: both stages are complete and are not trained again
    again = linearize(LinearizeConfig(teacher=str(teacher_dir), out=str(out), recipe="t2r", seq_len=96,
                                      transfer_steps=4, finetune_steps=4, corpus_max_bytes=CORPUS, eval_batches=2,
                                      contexts=(), recall=4), progress=False)
    assert again["tokens"] == {"stage1": 0, "stage2": 0}


def test_cli_runs_and_refuses_bad_input_in_one_line(teacher_dir, tmp_path, capsys):
    args = ["linearize", "--teacher", str(teacher_dir), "--recipe", "liger", "--seq-len", "64", "--finetune-steps", "2",
            "--corpus-max-bytes", str(CORPUS), "--eval-batches", "1", "--contexts", "70", "--quiet", "--out",
            str(tmp_path / "cli")]
    assert main(args) == 0
    assert "gap recovered" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model" / "config.json").exists()
    assert main(["linearize", "--teacher", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linattn linearize: error: teacher") and err.count("\n") == 1
    assert main(["linearize", "--out", str(tmp_path / "y")]) == 2
    assert "--teacher" in capsys.readouterr().err


def test_a_tiny_random_llama_is_linearized_by_one_command(tmp_path, capsys):
    """A transformers Llama folder (random weights, byte vocabulary) through `linattn linearize`: the
    teacher is converted losslessly first, then both stages run."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")
    code = main(["linearize", "--teacher", str(tmp_path / "llama"), "--recipe", "lolcats", "--seq-len", "96",
                 "--transfer-steps", "5", "--finetune-steps", "5", "--corpus-max-bytes", str(CORPUS),
                 "--eval-batches", "1", "--contexts", "100", "--quiet", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    student = LinearTransformerLM.from_pretrained(tmp_path / "out" / "model")
    assert student.config.layer_kinds == ["lolcats", "lolcats"] and student.config.n_heads == 4
    assert (tmp_path / "out" / "teacher-linattn" / "config.json").exists()


def test_the_experiment_preset_aggregates_seeds_and_resumes(tmp_path):
    from linattn.linearize.experiment import run_experiment

    small = dict(teacher_overrides={"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "attention": "softmax",
                                              "positions": "rope"}, "steps": 6, "seq_len": 96, "batch_size": 4,
                                    "corpus_max_bytes": CORPUS, "eval_batches": 1, "warmup_steps": 1},
                 linearize_overrides={"seq_len": 96, "batch_size": 4, "transfer_steps": 3, "finetune_steps": 3,
                                      "eval_batches": 1, "recall": 4, "corpus_max_bytes": CORPUS},
                 seeds=(0, 1), recipes=("liger", "t2r"), contexts=(100,), progress=False)
    report = run_experiment(tmp_path, **small)
    rows = {r["recipe"]: r for r in report["recipes"]}
    assert set(rows) == {"liger", "t2r"} and "stage 1" in rows["t2r"] and "stage 1" not in rows["liger"]
    for r in rows.values():
        b = r["stage 2"]["bpb"]
        assert len(b["values"]) == 2 and b["worst"] == max(b["values"])
        assert b["mean"] == pytest.approx(sum(b["values"]) / 2)
        assert r["decode"][0]["cache_bytes"] > 0
    assert report["teacher"]["decode"][0]["cache_bytes"] > rows["t2r"]["decode"][0]["cache_bytes"]
    for name in ("linearize.json", "linearize.md", "linearize.png", "decode.json"):
        assert (tmp_path / name).stat().st_size > 0
    mtime = (tmp_path / "t2r-seed1" / "linearize.json").stat().st_mtime
    again = run_experiment(tmp_path, **small)  # everything is read back, nothing trained again
    assert (tmp_path / "t2r-seed1" / "linearize.json").stat().st_mtime == mtime
    assert again["recipes"] == report["recipes"]
    assert again["teacher"]["tokens"] == report["teacher"]["tokens"] == 6 * 4 * 96  # the run's, not this call's
