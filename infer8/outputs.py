"""What the engine returns per request (vLLM's RequestOutput shape) and how text is tracked."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer8.request import Request
from infer8.tokenizer import IncrementalDetokenizer, Tokenizer

# (token_id -> logprob) for the sampled token and the top-k alternatives at one position
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated sequence: cumulative text and tokens, plus what this step added."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        """Return whether the sequence is done."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


class RequestState:
    """Owns one request's detokenizer, stop-string check and logprobs between steps."""

    def __init__(self, request: Request, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.prompt = prompt
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent_text_len = 0
        self.sent_token_len = 0
        self.stopped_by_string = False
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None

    def add_tokens(
        self, new_token_ids: list[int], logprobs: tuple[float, list[tuple[int, float]]] | None
    ) -> str | None:
        """Detokenize new tokens; return the stop string if one now appears in the text."""
        if logprobs is not None and self.logprobs is not None:
            sampled_lp, top = logprobs
            entry = dict(top)
            entry[new_token_ids[-1]] = sampled_lp
            self.logprobs.append(entry)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sampled_lp
        before = len(self.text)
        self.text += self.detok.add_tokens(new_token_ids)
        if not self.stop or len(self.text) == before:
            return None
        search_from = max(0, before - self.max_stop_len + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        self.stopped_by_string = True
        self.text = self.text[: idx + (len(stop) if self.include_stop else 0)]
        return stop

    def make_output(self, request: Request) -> RequestOutput:
        """Return the cumulative output and the delta since the last call."""
        finished = request.is_finished
        if finished and not self.stopped_by_string:
            self.text += self.detok.flush()
        # While running, hold back a tail that could still become a stop string.
        visible = (
            len(self.text)
            if finished
            else max(self.sent_text_len, len(self.text) - max(0, self.max_stop_len - 1))
        )
        tokens = request.output_token_ids
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            delta_text=self.text[self.sent_text_len : visible],
            delta_token_ids=list(tokens[self.sent_token_len :]),
        )
        self.sent_text_len = visible
        self.sent_token_len = len(tokens)
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
        )
