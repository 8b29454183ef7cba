"""ByteTokenizer: the byte-level vocabulary of `linattn train`'s byte LM as a transformers tokenizer.

linattn.training.data reads text as raw bytes: token id t is the byte t (vocabulary 256, no special
tokens). ByteTokenizer encodes a string as its UTF-8 bytes and decodes ids back to bytes, then to
text (invalid UTF-8, e.g. a sequence cut inside a character, becomes U+FFFD). Each token's string
form is the Latin-1 character of its byte (chr(t)), so the 256 tokens are distinct one-character
strings and `convert_tokens_to_string` is exact.

Special tokens are bytes too (no id beyond 255 is ever made): pad_token defaults to "\\x00" (id 0,
the pad linattn.models.generation uses); bos/eos default to none. Pass e.g. eos_token="\\n" to stop
generation at a newline.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer

VOCAB_SIZE = 256


class ByteTokenizer(PreTrainedTokenizer):
    """Raw UTF-8 bytes, ids 0 … 255 (see the module docstring)."""

    vocab_files_names: dict = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, pad_token="\x00", bos_token=None, eos_token=None, unk_token=None, **kwargs):
        for name, tok in (("pad_token", pad_token), ("bos_token", bos_token), ("eos_token", eos_token),
                          ("unk_token", unk_token)):
            text = str(tok) if tok is not None else None
            if text is not None and (len(text) != 1 or ord(text) >= VOCAB_SIZE):
                raise ValueError(f"{name} must be one byte (a character below U+0100), got {tok!r}")
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(pad_token=pad_token, bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(VOCAB_SIZE)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) != 1 or ord(token) >= VOCAB_SIZE:
            raise ValueError(f"token must be one byte (a character below U+0100), got {token!r}")
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= int(index) < VOCAB_SIZE:
            raise ValueError(f"token id must lie in [0, {VOCAB_SIZE}), got {index}")
        return chr(int(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is the 256 bytes: nothing to write


__all__ = ["ByteTokenizer", "VOCAB_SIZE"]
