"""Grammar-constrained decoding in the engine: random-weight models still emit only valid output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from infer8.attention.exact_tail import DEFAULT_EXACT_SINK_TOKENS, DEFAULT_EXACT_TAIL_TOKENS
from infer8.attention.kv_cache import KVCacheSpec
from infer8.entrypoints.llm import LLM
from infer8.sampling_params import SamplingParams
from infer8.structured_output import StructuredOutputsParams
from tests.utils import build_tiny_model

SCHEMA = {  # short keys: a byte-level toy tokenizer spends about one token per character
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "blue"]},
        "ok": {"type": "boolean"},
        "s": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "maxItems": 2},
        "n": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}},
            "required": ["k"],
            "additionalProperties": False,
        },
    },
    "required": ["c", "ok", "s", "n"],
    "additionalProperties": False,
}
# Compact JSON: a random model cannot wander off into endless whitespace, so outputs end.
JSON_PARAMS = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


def _llm(model_dir: Path, **kwargs: object) -> LLM:
    args: dict[str, object] = dict(
        dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=512
    )
    args.update(kwargs)
    return LLM(str(model_dir), **args)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_json_schema_outputs_parse_and_validate(
    arch: str, llama_dir: Path, qwen2_dir: Path
) -> None:
    llm = _llm(llama_dir if arch == "llama" else qwen2_dir)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=150, structured_outputs=JSON_PARAMS)
        for i in range(8)
    ] + [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=JSON_PARAMS)]
    free = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constrained))] + PROMPTS
    outs = llm.generate(prompts, constrained + [free] * len(PROMPTS), use_tqdm=False)
    for out in outs[: len(constrained)]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    # Unconstrained requests in the same batch are untouched: same tokens as run alone.
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[len(constrained) :]] == [
        o.outputs[0].token_ids for o in alone
    ]
    stats = llm.engine.structured_output.stats
    assert stats.num_compiles == 1 and stats.num_cache_hits >= len(constrained) - 1
    assert llm.engine.structured_output.num_requests == 0  # matchers dropped when finished


def test_regex_choice_grammar_and_json_object(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    regex = r"[0-9]{3}-[a-c]{2}(x|yz)"
    choices = ["alpha", "beta gamma", 'quote " and \\ slash']
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= "a" | "bb" | [0-9]'
    cases = [
        (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputsParams(choice=choices), lambda t: t in choices),
        (
            StructuredOutputsParams(grammar=grammar),
            lambda t: re.fullmatch(r"\((a|bb|\d)(,(a|bb|\d))*\)", t),
        ),
    ]
    for so, check in cases:
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_outputs=so)
            for s in range(4)
        ]
        for out in llm.generate(PROMPTS[:2] * 2, params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop"
            assert check(out.outputs[0].text), (so.kind, out.outputs[0].text)
    # json_object: with a random model the object may not close within max_tokens, but every
    # output is a prefix the grammar accepted, and the ones that stopped parse as objects.
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs=so)
        for s in range(4)
    ]
    for out in llm.generate(PROMPTS[:2] * 2, params, use_tqdm=False):
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_completed_grammar_ends_the_request_even_with_ignore_eos(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    so = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=so)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 50


def test_grammar_holds_with_fp8_cache_prefix_caching_and_preemption(llama_dir: Path) -> None:
    # 17 blocks x 16 tokens for 6 requests of ~80 tokens forces preemptions; the rest of the
    # budget holds the exact tail's store (one row per seat, 6 seats; the default tail).
    spec = KVCacheSpec(
        2, 2, 16, 16, torch.float8_e4m3fn, DEFAULT_EXACT_TAIL_TOKENS, DEFAULT_EXACT_SINK_TOKENS
    )  # the tiny llama: 2 layers, 2 KV heads of 16
    llm = _llm(
        llama_dir,
        kv_cache_dtype="fp8",
        enable_prefix_caching=True,
        kv_cache_memory_bytes=17 * spec.bytes_per_block + spec.tail_bytes(6),
        max_num_seqs=6,
        max_model_len=128,
    )
    assert llm.engine.num_tail_rows == 6 and llm.engine.num_blocks == 17
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=JSON_PARAMS)
        for s in range(6)
    ]
    preemptions: list[int] = []
    llm.engine.stat_loggers.append(lambda stats: preemptions.append(stats.num_preemptions))
    prompt = list(range(40, 80))  # a shared 40-token prefix
    outs = llm.generate([prompt + [s] for s in range(6)], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert sum(preemptions) > 0 and llm.engine.num_blocks < 6 * 5


def test_invalid_constraints_are_refused_before_running(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    bad = [
        (dict(json={"type": "objectx"}), "objectx"),
        (dict(regex="a(b"), "parenthesis"),
        (dict(grammar='root ::= "a" |'), "EBNF"),
    ]
    for fields, message in bad:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    assert not llm.engine.has_unfinished_requests()


def test_tokenizer_info_of_the_default_models_gguf_tokenizer() -> None:
    import xgrammar as xgr

    from infer8.models.default_model import pull_default_model
    from infer8.structured_output.tokenizer_info import build_tokenizer_info
    from infer8.tokenizer import Tokenizer

    # The cached default model's tokenizer.json was built from the GGUF file's metadata.
    tok = Tokenizer.from_dir(pull_default_model())
    info = build_tokenizer_info(tok, 49152)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == 49152
    assert info.stop_token_ids == [2]  # <|im_end|>
    # xgrammar's bytes of each token are what our tokenizer decodes it to.
    text = ' {"city": "Paris", "temp": 21.5, "note": "café ☀"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(info.decoded_vocab[i] for i in ids) == text.encode()
    compiler = xgr.GrammarCompiler(info)
    matcher = xgr.GrammarMatcher(compiler.compile_builtin_json_grammar())
    assert all(matcher.accept_token(i) for i in tok.encode(text[1:], add_special_tokens=False))
    assert matcher.accept_token(2) and matcher.is_terminated()
    bad = xgr.GrammarMatcher(compiler.compile_builtin_json_grammar())
    assert not bad.accept_token(tok.encode("Paris", add_special_tokens=False)[0])


def test_json_grammars_bound_whitespace_runs_on_the_default_tokenizer() -> None:
    import xgrammar as xgr

    from infer8.models.default_model import pull_default_model
    from infer8.structured_output.manager import MAX_WHITESPACE_CHARS, StructuredOutputManager
    from infer8.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(pull_default_model())
    manager = StructuredOutputManager(tok, 49152)
    value = {"c": "red", "ok": True, "s": [1, 2], "n": {"k": "a"}}
    pretty = json.dumps(value, indent=4)  # deepest run: a newline and 8 spaces
    longest = "{\n" + " " * (MAX_WHITESPACE_CHARS - 1)  # a run the bound allows

    def accepts(so: StructuredOutputsParams, text: str) -> bool:
        matcher = xgr.GrammarMatcher(manager.compile(so))
        ids = tok.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(2)

    for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True)):
        assert accepts(so, json.dumps(value)) and accepts(so, pretty)
        # A sampled model cannot spend its max_tokens on one run of whitespace.
        assert accepts(so, pretty.replace("{\n    ", longest, 1))
        assert not accepts(so, pretty.replace("{\n    ", longest + " ", 1))
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert not accepts(compact, pretty)
    assert accepts(compact, json.dumps(value))  # xgrammar's compact form: ", " and ": "


def test_llm_chat_renders_tools_and_a_named_call_parses(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The tool description is long in a toy tokenizer's tokens: a longer context is needed.
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("chat_tools"), "llama", max_position_embeddings=1024
    )
    llm = _llm(model_dir, max_model_len=1024)
    args_schema = {
        "type": "object",
        "properties": {"x": {"enum": [1, 2]}},
        "required": ["x"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": args_schema}}]
    so = StructuredOutputsParams(json=args_schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so)
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "done"},
    ]
    out = llm.chat(messages, params, use_tqdm=False, tools=tools)[0]
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    # The toy ChatML template knows no tools: they are described in a system message, and the
    # earlier call is written in Hermes form.
    assert prompt.startswith("<|im_start|>system\n") and '"name": "f"' in prompt
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\ndone" in prompt
    jsonschema.validate(json.loads(out.outputs[0].text), args_schema)
