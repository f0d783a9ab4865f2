"""Tokenizer, chat template and incremental detokenization (tokenizers + jinja2, no transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from infer8.chat_template import ChatTemplate, TemplateBudget


def _token_str(value: Any) -> str | None:
    """Return a special token's text from tokenizer_config (str or AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Owns the fast tokenizer, special tokens and the chat template of one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        tokenizer_config: dict[str, Any],
        eos_token_ids: list[int],
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self.config = tokenizer_config
        self.bos_token = _token_str(tokenizer_config.get("bos_token"))
        self.eos_token = _token_str(tokenizer_config.get("eos_token"))
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # What one rendering of the chat template may spend (servers lower max_chars to what
        # their context can hold: tokenizing 16 Mi characters takes ~30 s and 2 GB).
        self.template_budget = TemplateBudget()
        self._template: ChatTemplate | None = None
        # The longest vocabulary entry: no token covers more characters of (normalized) text.
        self.max_token_chars = max(
            (len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1
        )

    def min_num_tokens(self, num_chars: int) -> int:
        """Return a lower bound on the tokens of a text of num_chars characters.

        Each token covers at most max_token_chars characters; the factor 2 leaves room for a
        normalizer that drops characters. Lets a server refuse a prompt far over the context
        without tokenizing it (1 MB of text costs ~0.5 s of CPU to tokenize).
        """
        return num_chars // (2 * self.max_token_chars)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from a directory."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template", template)
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        gen_cfg = _read_json(d / "generation_config.json")
        model_cfg = _read_json(d / "config.json")
        return cls(tok, cfg, _eos_ids(tok, cfg, gen_cfg, model_cfg), template)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """Return the underlying `tokenizers` object (for libraries that read the vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Return the tokenizer's vocabulary size (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return token ids for text (the batch call releases the GIL: other threads run on).

        Raises ValueError for text that is not valid Unicode (a lone surrogate such as the
        JSON escape "\\ud800"), which no tokenizer can encode.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text is not valid Unicode (a lone surrogate at character {e.start})"
            ) from None
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Return the text of token ids."""
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """Return one token's decoded text."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def set_chat_template(self, template_or_path: str) -> None:
        """Replace the model's chat template (a Jinja string, or a file holding one)."""
        if "{" not in template_or_path:
            path = Path(template_or_path)
            if not path.is_file():
                raise ValueError(f"chat template {template_or_path!r}: no such file")
            template_or_path = path.read_text()
        self.chat_template = template_or_path
        self._template = None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template, under the template budget.

        Raises ChatTemplateError (a ValueError) when the template fails or runs over its
        budget: its rendering stops there, freeing the thread.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(
            self.template_budget,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Return the prompt token ids of a chat (the template adds any BOS itself)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _eos_ids(
    tok: HFTokenizer, cfg: dict[str, Any], gen_cfg: dict[str, Any], model_cfg: dict[str, Any]
) -> list[int]:
    """Collect EOS ids from generation_config, config and the tokenizer's eos_token."""
    ids: list[int] = []
    for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
        if source is not None:
            ids.extend(source if isinstance(source, list) else [source])
    eos = _token_str(cfg.get("eos_token"))
    if eos is not None and tok.token_to_id(eos) is not None:
        ids.append(tok.token_to_id(eos))
    return sorted(set(ids))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (vLLM's prefix/read offsets)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first output tokens their leading-space context.
        self.token_ids = list(prompt_token_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (held back while a char is partial)."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Return text still held back (an incomplete character) when the sequence ends."""
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
