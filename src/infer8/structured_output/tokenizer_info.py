"""Build xgrammar's TokenizerInfo from infer8's tokenizer (vocabulary, byte encoding, stops)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

    from infer8.tokenizer import Tokenizer


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """Return the TokenizerInfo of a tokenizer for a model whose logits have vocab_size columns.

    The vocabulary, its encoding (byte-level, byte-fallback or raw) and add_prefix_space are
    detected by xgrammar from the tokenizers object (tokenizer.json, or one rebuilt from GGUF
    metadata); the stop tokens are the model's EOS ids.
    """
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in (tokenizer.eos_token, tokenizer.bos_token) if t]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.hf_tokenizer, additional_special_tokens=specials
    )
    return xgr.TokenizerInfo.from_huggingface(
        wrapped, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
    )
