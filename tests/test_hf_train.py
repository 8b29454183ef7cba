"""linattn.hf: Trainer with labels, pipeline("text-generation") with the byte tokenizer."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import linattn.hf as H  # noqa: E402
from linattn.models import LinearTransformerLM, ModelConfig  # noqa: E402


def tiny_lm(**over):
    kw = dict(vocab_size=256, d_model=16, n_layers=2, n_heads=2, attention="gated_deltanet,softmax", seed=2,
              chunk_size=8)
    kw.update(over)
    return LinearTransformerLM(ModelConfig(**kw))


def test_byte_tokenizer_is_the_byte_lm_vocabulary(tmp_path):
    tok = H.ByteTokenizer()
    text = "héllo\nwörld ✓"
    enc = tok(text)["input_ids"]
    assert enc == list(text.encode("utf-8"))
    assert tok.decode(enc) == text
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # cut inside a character
    assert len(tok) == 256 and tok.pad_token_id == 0 and tok.eos_token_id is None
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[0, 0, 97, 98], [97, 98, 99, 100]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    tok2 = H.ByteTokenizer(eos_token="\n")
    assert tok2.eos_token_id == 10
    tok2.save_pretrained(tmp_path)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(back, H.ByteTokenizer) and back.eos_token_id == 10 and back("x")["input_ids"] == [120]
    with pytest.raises(ValueError, match="eos_token"):
        H.ByteTokenizer(eos_token="<eos>")


class _Windows(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor, n: int):
        self.data, self.n = data, n

    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = self.data[i * 3: i * 3 + self.n]
        return {"input_ids": x, "labels": x.clone()}


def test_trainer_trains_a_few_steps(tmp_path):
    lm = tiny_lm()
    hf = H.LinattnForCausalLM.from_linattn(lm)
    text = ("the quick brown fox jumps over the lazy dog. " * 8).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    before = {k: v.detach().clone() for k, v in hf.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=_Windows(data, 32))
    with torch.no_grad():
        first = float(hf(data[None, :32], labels=data[None, :32]).loss)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    with torch.no_grad():
        after = float(hf.eval()(data[None, :32], labels=data[None, :32]).loss)
    assert after < first
    changed = [k for k, v in hf.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert len(changed) == len(before)


@pytest.mark.parametrize("every", [1, 2])
def test_trainer_with_gradient_checkpointing_checkpoints_the_blocks(tmp_path, monkeypatch, every):
    """Issue 37 item 11: Trainer(gradient_checkpointing=True) called activation_checkpointing_enable(…,
    every_n_layers=…, offload=…), which LinattnForCausalLM's own gradient_checkpointing_enable did not
    take (TypeError). Now training checkpoints every `every_n_layers`-th block (counted), with the
    gradients of the run without checkpointing."""
    import linattn.models.lm as lm_module

    calls = []
    real = lm_module.checkpoint
    monkeypatch.setattr(lm_module, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))
    lm = tiny_lm(n_layers=4, attention="gated_deltanet,softmax")
    hf = H.LinattnForCausalLM.from_linattn(lm)
    data = torch.tensor(list(("the quick brown fox jumps over the lazy dog. " * 8).encode()), dtype=torch.long)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True,
                                          gradient_checkpointing_kwargs={"every_n_layers": every})
    transformers.Trainer(model=hf, args=args, train_dataset=_Windows(data, 32)).train()
    assert hf.is_activation_checkpointing
    assert calls and [list(lm.blocks).index(b) for b in calls[:4 // every]] == list(range(0, 4, every))
    calls.clear()
    x = data[None, :32]
    hf.train()
    hf.zero_grad()
    hf(x, labels=x).loss.backward()
    assert len(calls) == 4 // every
    got = [p.grad.clone() for p in hf.parameters()]
    hf.activation_checkpointing_disable()
    assert not hf.is_activation_checkpointing
    hf.zero_grad()
    hf(x, labels=x).loss.backward()
    assert len(calls) == 4 // every  # no more checkpointed calls
    for a, p in zip(got, hf.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_unsupported_checkpointing_options_are_refused_by_name():
    hf = H.LinattnForCausalLM.from_linattn(tiny_lm())
    for kw, name in ((dict(offload=True), "offload"), (dict(every_n_layers=0), "every_n_layers"),
                     (dict(activation_checkpointing_kwargs={"use_reentrant": True}), "use_reentrant")):
        with pytest.raises(ValueError, match=name):
            hf.activation_checkpointing_enable(**kw)
    assert not hf.is_activation_checkpointing


def test_pipeline_text_generation_matches_linattn_generate():
    lm = tiny_lm().eval()
    hf = H.LinattnForCausalLM.from_linattn(lm)
    tok = H.ByteTokenizer()
    pipe = transformers.pipeline("text-generation", model=hf, tokenizer=tok, device="cpu")
    out = pipe("Once upon", max_new_tokens=12, do_sample=False, return_full_text=False)
    want = lm.generate(list(b"Once upon"), 12, temperature=0)[0]
    assert out[0]["generated_text"] == bytes(want).decode("utf-8", errors="replace")
