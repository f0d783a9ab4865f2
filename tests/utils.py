"""Shared test builders: tiny random-weight Llama / Qwen2 models, and a server in a thread."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.server import create_app

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


def float_ordinals(t: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as a monotonic integer (sign-magnitude, -0 == +0), so that
    neighbouring representable values of t's dtype (FP8, bf16, float32) are 1 apart."""
    bits = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).long()
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


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


@dataclass
class RunningServer:
    """A server started in this process on 127.0.0.1 and the engine behind it."""

    url: str
    engine: LLMEngine
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str = "EMPTY"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        # With API keys /metrics needs one (by default); a key sent to an open /metrics is ignored.
        headers = {"Authorization": f"Bearer {self.api_key}"}
        text = httpx.get(f"{self.url}/metrics", headers=headers).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return sum(
            value
            for (sample, sample_labels), value in self.metrics().items()
            if sample == name and set(labels.items()) <= set(sample_labels)
        )

    def wait_until(self, ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.02)

    def wait_idle(self) -> None:
        """Wait until nothing runs and every KV block is free again."""
        self.wait_until(
            lambda: (
                self.metric("vllm:kv_cache_usage_perc") == 0.0
                and self.metric("vllm:num_requests_running") == 0.0
                and self.metric("vllm:num_requests_waiting") == 0.0
            )
        )


def start_server(engine: LLMEngine, config: ServerConfig) -> RunningServer:
    """Serve the engine on a free port of 127.0.0.1 from a thread; return once it listens."""
    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    keys = config.api_keys()
    return RunningServer(url, engine, server, thread, keys[0] if keys else "EMPTY")


def stop_server(running: RunningServer) -> None:
    """Ask the server to exit and wait for its thread."""
    running.server.should_exit = True
    running.thread.join(20)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout_s: float = 120.0) -> None:
    """Wait until a server subprocess answers /health with 200 (fail with its output if it dies)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def wait_for_js(page: Any, expression: str, timeout: float = 30_000) -> None:
    """Poll a JavaScript expression from Python until it is truthy (timeout in ms).

    Playwright's own wait_for_function re-evaluates its predicate with eval inside the page,
    which the console's content security policy (no 'unsafe-eval') rightly refuses.
    """
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.05)


@contextlib.contextmanager
def infer8_log_messages() -> Iterator[list[str]]:
    """Collect the messages infer8's loggers emit at INFO and above while the block runs."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("infer8"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
