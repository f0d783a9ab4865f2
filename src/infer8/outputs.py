"""What the engine returns per request (vLLM's RequestOutput shape) and how text is tracked."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer8.request import Request
from infer8.sampling_params import RequestOutputKind
from infer8.tokenizer import IncrementalDetokenizer, Tokenizer

# (token_id -> logprob) for the sampled token and the top-k alternatives at one position
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated sequence: text and tokens so far, plus what this step added.

    With `RequestOutputKind.DELTA`, `text`, `token_ids` and `logprobs` hold only this step's
    part (the same as the delta fields), so a long answer costs O(1) per step, not O(length).
    """

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
    error: str | None = None  # set when finish_reason is "error": this request failed alone


class RequestState:
    """Owns one request's detokenizer, stop-string check and logprobs between steps."""

    def __init__(self, request: Request, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.prompt = prompt
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        self.stop = params.stop
        self.is_delta = params.output_kind == RequestOutputKind.DELTA
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
        """Return the output (cumulative or delta, as the request asked) since the last call."""
        finished = request.is_finished
        if finished and not self.stopped_by_string and request.error is None:
            self.text += self.detok.flush()
        # While running, hold back a tail that could still become a stop string.
        visible = (
            len(self.text)
            if finished
            else max(self.sent_text_len, len(self.text) - max(0, self.max_stop_len - 1))
        )
        tokens = request.output_token_ids
        delta_text = self.text[self.sent_text_len : visible]
        delta_token_ids = tokens[self.sent_token_len :]
        logprobs = self.logprobs
        if self.is_delta and logprobs is not None:
            logprobs = logprobs[len(logprobs) - len(delta_token_ids) :]
            self.logprobs = []
        completion = CompletionOutput(
            index=0,
            text=delta_text if self.is_delta else self.text,
            token_ids=list(delta_token_ids) if self.is_delta else list(tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_token_ids,
        )
        self.sent_text_len = visible
        self.sent_token_len = len(tokens)
        if self.is_delta:  # keep only what a stop string could still need
            drop = max(0, self.sent_text_len - self.max_stop_len)
            self.text = self.text[drop:]
            self.sent_text_len -= drop
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
        )


def error_output(request: Request) -> RequestOutput:
    """Return the final output of a request that failed alone: no new text, its error."""
    completion = CompletionOutput(0, "", [], None, None, finish_reason="error")
    return RequestOutput(
        request.request_id, None, request.prompt_token_ids, [completion], True, error=request.error
    )
