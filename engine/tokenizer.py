"""Tokenizers: the checkpoint's tokenizer.json through `tokenizers`, or raw bytes when a
checkpoint has none (ids 0-255 are bytes; larger ids decode to nothing)."""

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """encode / decode, plus the special ids the engine needs."""

    def __init__(
        self,
        hf: HFTokenizer | None,
        vocab_size: int,
        eos_token_id: int | None,
        bos_token_id: int | None,
    ) -> None:
        self._hf = hf
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)


def load_tokenizer(
    path: str | Path,
    vocab_size: int,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> Tokenizer:
    file = Path(path) / "tokenizer.json"
    hf = HFTokenizer.from_file(str(file)) if file.exists() else None
    return Tokenizer(hf, vocab_size, eos_token_id, bos_token_id)
