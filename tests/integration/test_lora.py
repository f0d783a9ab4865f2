"""Multi-LoRA serving against transformers + peft: greedy tokens and logits per adapter in mixed
batches, prefix-cache isolation, the scheduler's --max-loras, and every bad-adapter error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from infer8 import LLM, LoRARequest, SamplingParams
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import build_tiny_model, start_server, stop_server

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 9, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 7, 7], [100, 3, 250, 12]]
NUM_NEW = 8


def make_adapter(
    model_dir: Path, out_dir: Path, seed: int, rank: int = 8, std: float = 0.15, **config: Any
) -> Path:
    """Save a PEFT LoRA adapter with random A and B (B is zero at PEFT's init) into out_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=config.pop("target_modules", TARGETS),
        init_lora_weights=False, **config,
    )  # fmt: skip
    model = get_peft_model(base, lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora_base"), "llama")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        make_adapter(model_dir, root / "a", 1, rank=8),
        make_adapter(model_dir, root / "b", 2, rank=4, target_modules=["q_proj", "v_proj"]),
        make_adapter(
            model_dir,
            root / "c",
            3,
            rank=16,
            use_rslora=True,
            target_modules=["o_proj", "down_proj", "up_proj"],
        ),  # fmt: skip
    ]


def hf_reference(
    model_dir: Path, adapter: Path | None, prompt: list[int], num_new: int = NUM_NEW
) -> tuple[list[int], torch.Tensor]:
    """Return transformers (+ peft) greedy tokens and the float32 logits of each step."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids, tokens, logits = list(prompt), [], []
    with torch.no_grad():  # greedy by hand: generate() would suppress EOS under min_new_tokens
        for _ in range(num_new):
            step = model(torch.tensor([ids])).logits[0, -1].float()
            tokens.append(int(step.argmax()))
            logits.append(step)
            ids.append(tokens[-1])
    return tokens, torch.stack(logits)


def test_mixed_batch_matches_transformers_and_peft(model_dir: Path, adapters: list[Path]) -> None:
    """Three adapters and the base in one batch: each request's greedy tokens equal
    transformers + peft's, its first-token logprobs within float32 rounding."""
    llm = LLM(model=str(model_dir), dtype="float32", enable_lora=True, max_loras=4,
              max_lora_rank=16, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapters)]
    per_prompt = [loras[0], loras[1], loras[2], None]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, lora_request=per_prompt)
    for prompt, lora, out in zip(PROMPTS, per_prompt, outs):
        tokens, logits = hf_reference(
            model_dir, None if lora is None else Path(lora.lora_path), prompt
        )
        assert out.outputs[0].token_ids == tokens, (lora, out.outputs[0].token_ids, tokens)
        ref = torch.log_softmax(logits[0], -1)
        top = out.outputs[0].logprobs[0]
        for token_id, lp in top.items():
            value = lp.logprob if hasattr(lp, "logprob") else lp
            # float32 sums in another order: ~1e-6 relative on logits of magnitude ~10
            assert abs(value - ref[token_id].item()) < 1e-4, (lora, token_id)
    # the adapters change the answers (else the comparison above proves little)
    base = llm.generate(PROMPTS[:3], params)
    assert sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outs, base)) >= 2


def _engine(model_dir: Path, **kwargs: Any) -> LLMEngine:
    values: dict[str, Any] = dict(model=str(model_dir), dtype="float32", enable_lora=True,
                                  max_lora_rank=16, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    values.update(kwargs)
    return LLMEngine(EngineArgs(**values))


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_max_loras_bounds_adapters_per_step_and_the_prefix_cache_is_keyed_by_adapter(
    model_dir: Path, adapters: list[Path]
) -> None:
    """With --max-loras 1, requests of two adapters never run in the same step, yet all finish
    with their own adapter's tokens; a prompt cached under one adapter is no hit for another
    adapter or the base model, and is one for the same adapter."""
    engine = _engine(model_dir, max_loras=1, max_cpu_loras=1)
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapters[:2])]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(10, 60))  # three full blocks of 16
    ids = {engine.add_request(prompt, params, lora_request=loras[i % 2]): i % 2 for i in range(4)}
    steps: list[set[int]] = []
    engine.stat_loggers.append(lambda stats: steps.append(
        {ids[r] for r in stats.scheduled_req_ids if r in ids}
    ))  # fmt: skip
    tokens = _run(engine)
    assert all(len(kinds) <= 1 for kinds in steps) and {0, 1} <= set().union(*steps)
    for adapter in (0, 1):
        got = {tuple(tokens[r]) for r, a in ids.items() if a == adapter}
        assert len(got) == 1, got  # every request of one adapter: the same tokens
    assert {tuple(tokens[r]) for r, a in ids.items() if a == 0} != {
        tuple(tokens[r]) for r, a in ids.items() if a == 1
    }
    # prefix cache: the blocks cached under adapters 0 and 1 serve only them
    for lora, expect_hit in [(None, False), (loras[0], True)]:
        engine.add_request(prompt, params, lora_request=lora)
        engine.step()
        stats = engine.last_stats
        assert (stats.num_prefix_cache_hits > 0) == expect_hit, (lora, stats)
        _run(engine)


def test_server_lora_modules_models_requests_metrics_and_runtime_updates(
    model_dir: Path, adapters: list[Path]
) -> None:
    """--lora-modules serves adapters by name beside the base (/v1/models lists their parent),
    a request's `model` picks its adapter (the same tokens as LLM with it), an unknown name is
    404; runtime load/unload (on with the flag) while a request runs; vllm:lora_requests_info."""
    base = "tiny-base"
    config = ServerConfig(
        lora_modules=(f"a={adapters[0]}", json.dumps({"name": "b", "path": str(adapters[1]),
                                                      "base_model_name": base})),
        allow_runtime_lora_updating=True,
    )  # fmt: skip
    running = start_server(_engine(model_dir, max_loras=2, served_model_name=base), config)
    try:
        client = running.client()
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {base, "a", "b"}
        assert models["a"].parent == base and models["a"].root == str(adapters[0])
        prompt = [5, 9, 17, 33, 2, 8]
        expected = hf_reference(model_dir, adapters[0], prompt)[0]
        got = client.completions.create(model="a", prompt=prompt, max_tokens=NUM_NEW,
                                        temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == running.engine.tokenizer.decode(expected)
        with pytest.raises(openai.NotFoundError, match="`c` does not exist"):
            client.completions.create(model="c", prompt="hi", max_tokens=2)
        post = lambda path, body: httpx.post(f"{running.url}{path}", json=body, timeout=30)  # noqa: E731
        bad = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(model_dir)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        for taken in ("a", base):  # an adapter's name, the served model's
            dup = post("/v1/load_lora_adapter", {"lora_name": taken, "lora_path": str(adapters[2])})
            assert dup.status_code == 400, dup.text
            assert (
                dup.json()["error"]["message"]
                == f"The lora adapter '{taken}' has already been loaded."
            )
        # a long request on c runs while c is unloaded: it finishes; new requests get 404
        ok = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters[2])})
        assert ok.status_code == 200, ok.text
        stream = client.completions.create(model="c", prompt=prompt, max_tokens=40,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        first = next(iter(stream))
        assert running.metric("vllm:lora_requests_info", running_lora_adapters="c") > 0
        assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
        rest = [first, *stream]
        assert rest[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt="hi", max_tokens=2)
        assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 404
        assert "c" not in {m.id for m in client.models.list().data}
    finally:
        stop_server(running)


def test_runtime_lora_endpoints_are_off_by_default(model_dir: Path) -> None:
    running = start_server(_engine(model_dir), ServerConfig())
    try:
        r = httpx.post(
            f"{running.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}
        )
        assert r.status_code == 404
    finally:
        stop_server(running)


@pytest.mark.slow
def test_default_model_adapters_match_transformers_and_peft(tmp_path: Path) -> None:
    """SmolLM2-135M with two random adapters and the base in one batch (float32): each
    request's 16 greedy tokens equal transformers + peft's."""
    from infer8.models.default_model import pull_default_model

    base = pull_default_model()
    adapters = [
        make_adapter(base, tmp_path / "x", 11, rank=8, std=0.05),
        make_adapter(
            base,
            tmp_path / "y",
            12,
            rank=16,
            std=0.05,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
    ]
    llm = LLM(model=str(base), dtype="float32", enable_lora=True, max_loras=2,
              kv_cache_memory_bytes=64 << 20)  # fmt: skip
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("Name three colours.", "What is 2 + 2?", "Write a haiku about the sea.")]  # fmt: skip
    loras = [LoRARequest("x", 1, str(adapters[0])), LoRARequest("y", 2, str(adapters[1])), None]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, outs):
        adapter = None if lora is None else Path(lora.lora_path)
        assert out.outputs[0].token_ids == hf_reference(base, adapter, prompt, 16)[0], lora
    plain = llm.generate(prompts[:2], params, use_tqdm=False)
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outs, plain))


@pytest.mark.browser
def test_console_chat_picks_an_adapter(model_dir: Path, adapters: list[Path]) -> None:
    """The chat page lists the base model and each adapter (with its parent); picking one
    sends its name as `model`."""
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (scripts/setup.sh installs it)")
    config = ServerConfig(lora_modules=(f"tuned={adapters[0]}",))
    running = start_server(_engine(model_dir, served_model_name="tiny-base"), config)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page()
            bodies: list[dict[str, Any]] = []
            page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
                    if r.url.endswith("/v1/chat/completions") else None)  # fmt: skip
            page.goto(running.url + "/")
            page.wait_for_selector("#model-select option >> nth=1", state="attached")
            options = page.eval_on_selector_all(
                "#model-select option", "els => els.map(e => e.textContent)"
            )
            assert options == ["tiny-base", "tuned (LoRA on tiny-base)"]
            page.select_option("#model-select", "tuned")
            page.fill("#max-tokens", "4")
            page.fill("#prompt", "hello")
            page.click("#send")
            page.wait_for_selector("#stop", state="hidden", timeout=20_000)
            browser.close()
        assert bodies and bodies[-1]["model"] == "tuned"
    finally:
        stop_server(running)


def test_bench_lora_groups_run_and_report(model_dir: Path, tmp_path: Path) -> None:
    """`infer8 bench lora`'s pieces: random adapters the checker accepts, a mixed group's W1
    through them, and the table."""
    from infer8.bench.lora import _run_group, format_lora, write_random_adapter
    from infer8.lora.peft import read_adapter
    from infer8.models.llama import LlamaArchConfig
    from infer8.models.loader import read_hf_config

    arch = LlamaArchConfig.from_hf_config(read_hf_config(model_dir))
    paths = [str(write_random_adapter(arch, tmp_path / f"r{i}", 4, seed=i)) for i in range(2)]
    assert read_adapter(paths[0], arch, 4).target_modules == TARGETS
    args = EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22,
                      max_num_batched_tokens=512)  # fmt: skip
    row = _run_group(args, "2 adapters", paths, num_requests=4, use_tqdm=False)
    assert row["num_adapters"] == 2 and row["output_tok_s"] > 0
    result = {"rows": [{**row, "round": 0, "ratio": 1.0}], "rank": 4, "num_requests": 4}
    assert "| 0 | 2 adapters |" in format_lora(result)
