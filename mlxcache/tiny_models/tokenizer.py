"""A small byte-level BPE tokenizer trained here on a built-in text (``tokenizers``)."""

from __future__ import annotations

from collections.abc import Sequence


def train_bpe(text: str, special_tokens: Sequence[str], vocab_size: int, unk: str | None):
    """A byte-level BPE trained on ``text`` (deterministic: one thread, one text).

    The special tokens take the first ids, in order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines() * 4, trainer=trainer)
    return tokenizer


def printable(text: str) -> bool:
    """True for a non-empty string of printable ASCII and newlines."""
    return bool(text) and all(c == "\n" or " " <= c <= "~" for c in text)


def never_ids(tokenizer) -> list[int]:
    """Ids whose text is not printable (special tokens, lone bytes): the output head's zero rows."""
    return [i for i in range(tokenizer.get_vocab_size()) if not printable(tokenizer.decode([i]))]
