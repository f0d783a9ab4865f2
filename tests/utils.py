"""Shared test builders: tiny random-weight Llama / Qwen2 models saved as Hugging Face dirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "one two three four five six seven eight nine ten eleven twelve",
    "def main():\n    return 42\n",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a tiny byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": CHATML,
            }
        )
    )


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a random-weight Llama or Qwen2 (GQA) model with a tokenizer into out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=4,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=16, **kwargs))
    elif arch == "qwen2":
        kwargs.setdefault("tie_word_embeddings", True)
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
        with torch.no_grad():  # give the q/k/v biases real values (they init to zero)
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    else:
        raise ValueError(arch)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir, vocab_size=300)
    return out_dir


def hf_model(model_dir: Path) -> Any:
    """Load the reference transformers model in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Return transformers' greedy continuation of one prompt (EOS not honoured)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
