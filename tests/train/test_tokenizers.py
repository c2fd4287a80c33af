"""gpipe.train.tokenizers: bytes are the tokens where a folder has no tokenizer of its own
(a folder's own, against the tokenizer called by hand: train/test_hf.py)."""

from __future__ import annotations

from gpipe.train.tokenizers import ByteTokenizer


def test_bytes_are_the_tokens_and_decode_back_with_escapes():
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("é\n".encode()) == [195, 169, 10]
    assert tokenizer.tokens(b"ab").tolist() == [97, 98] and tokenizer.tokens(b"").numel() == 0
    assert tokenizer.decode([195, 169, 255]) == "é\\xff"
