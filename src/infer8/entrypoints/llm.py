"""The offline LLM class, shaped like vLLM's: generate() and chat() over an LLMEngine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.logging_setup import configure_logging
from infer8.lora.config import LoRARequest
from infer8.outputs import RequestOutput
from infer8.progress import progress_bar
from infer8.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Owns one LLMEngine and runs batches of prompts to completion."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        configure_logging()  # start-up facts (KV cache, memory) as log lines on stderr
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(
                f"unknown LLM option(s) {sorted(unknown)}; valid: {', '.join(EngineArgs.field_names())}"
            )
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def get_default_sampling_params(self) -> SamplingParams:
        """Return SamplingParams with the model's generation-config defaults (vLLM's method)."""
        return SamplingParams(**self.engine.default_sampling)

    def get_tokenizer(self) -> Any:
        """Return the engine's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt, in order.

        A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids" and
        optionally "cache_salt" (requests with different salts never share cached KV blocks).
        `priority` (one per prompt, lower first) needs scheduling_policy="priority", as in vLLM.
        `lora_request`: a LoRA adapter for every prompt, or one (or None) per prompt; needs
        enable_lora=True.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params_list)} sampling params"
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        engine_prompts = [_as_engine_prompt(p) for p in prompts]
        return self._run(engine_prompts, params_list, use_tqdm, priorities, loras)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and generate.

        `tools` (OpenAI's function tools) are rendered into the prompt; to force a call, pass
        SamplingParams(structured_outputs=...) with the function's parameter schema.
        """
        from infer8.entrypoints.openai.protocol import APIError
        from infer8.entrypoints.openai.tool_calls import (
            render_tools,
            template_messages,
            tool_functions,
        )

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        try:
            functions = tool_functions(tools) if tools else []
        except APIError as e:
            raise ValueError(str(e)) from None
        prompts: list[Prompt] = []
        for conv in conversations:
            conv = template_messages(list(conv), tok.chat_template)  # type: ignore[arg-type]
            kwargs: dict[str, Any] = {}
            if functions:
                conv, kwargs = render_tools(conv, tok.chat_template, functions)
            prompts.append(
                tok.encode_chat(conv, add_generation_prompt=add_generation_prompt, **kwargs)
            )
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cached KV block; return how many were dropped."""
        return self.engine.reset_prefix_cache()

    def _run(
        self,
        prompts: list[tuple[str | list[int], str | None]],
        params: list[SamplingParams],
        use_tqdm: bool,
        priorities: list[int] | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        # Validate every prompt before queuing any, so a bad one leaves nothing half-run.
        ids = []
        try:
            for i, ((prompt, cache_salt), p) in enumerate(zip(prompts, params)):
                priority = 0 if priorities is None else priorities[i]
                lora = None if loras is None else loras[i]
                ids.append(engine.add_request(
                    prompt, p, cache_salt=cache_salt, priority=priority, lora_request=lora
                ))  # fmt: skip
        except ValueError:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2
        )
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            unfinished = [i for i in ids if i not in results]
            if unfinished:
                engine.abort_request(unfinished)
        return [results[i] for i in ids]


def _as_engine_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """Return (text or token ids, cache_salt) of one prompt."""
    if isinstance(prompt, dict):
        cache_salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), cache_salt
        return prompt["prompt"], cache_salt
    return prompt, None
