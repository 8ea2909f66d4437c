"""Request bodies of vLLM's OpenAI-compatible API, as the engine model accepts them.

Field names, defaults and bounds follow vLLM v0.11
(``vllm/entrypoints/openai/protocol.py``: ``CompletionRequest``,
``ChatCompletionRequest``, ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest``, ``StreamOptions``). Like vLLM,
unknown fields are accepted and ignored, and sampling knobs the engine model
cannot honour (``temperature``, ``top_p``, ``top_k``, penalties) are accepted
and have no effect. ``n > 1`` runs ``n`` engine requests; ``logprobs`` (and
chat's ``top_logprobs``) are answered in vLLM's shapes with made-up values (the
engine model has no distribution). Features it cannot fake convincingly
(``echo``, ``best_of``, ``use_beam_search``, ``suffix``, guided decoding)
are rejected with a 400 that names the field, instead of being silently wrong.

Validation that needs server state (the served model name, the scheduling
policy, ``max_model_len``) happens in ``app.py``. Errors raised here are
pydantic ``ValidationError``; :func:`validation_error` turns one into a
:class:`~slipstream_testbed.engine_server.errors.RequestError` naming the field.

Deliberately left out: response models. Responses are built as plain dicts
(and, on the streaming hot path, pre-rendered JSON fragments) in the exact
key order vLLM's ``model_dump`` produces; ``tests/contract`` checks them
against recorded vLLM shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slipstream_testbed.engine_server.errors import RequestError

_INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 128  # choices per request


class _Body(BaseModel):
    # vLLM's OpenAIBaseModel allows (and ignores) unknown fields.
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Body):
    """``stream_options``: usage in the last chunk, or in every chunk."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _GenerationParams(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: _INT64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    priority: _INT64 = 0
    request_id: str | None = None
    return_token_ids: bool | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _at_least_one_choice(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"n must be at least 1, got {v}.")
        if v > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {v}.")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported by the engine model")
        return v

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, v: bool) -> bool:
        if v:
            raise ValueError("beam search is not supported by the engine model")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature_range(cls, v: float | None) -> float | None:
        if v is not None and v < 0:
            raise ValueError(f"temperature must be non-negative, got {v}.")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return tuple(s for s in self.stop if s)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )


class CompletionRequest(_GenerationParams):
    """``POST /v1/completions``."""

    # Optional as in vLLM (which also takes prompt_embeds); a missing prompt is refused in
    # the serving layer, with BadRequestError (``single_prompt``), as vLLM 0.32 does.
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo=true is not supported by the engine model")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("`logprobs` must be a positive value.")
        if v is not None and v > MAX_LOGPROBS:
            raise ValueError(
                f"Requested sample logprobs of {v}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}"
            )
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("suffix is not currently supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, v: str | list[str] | list[int] | list[list[int]] | None
    ) -> str | list[str] | list[int] | list[list[int]] | None:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) and len(v) != 1:
            raise ValueError("only one prompt per request is supported by the engine model")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or as token ids."""
        p = self.prompt
        if p is None:
            raise RequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return [int(x) for x in p if isinstance(x, int)]


class TextPart(_Body):
    """One part of a message's content list; only text parts are supported."""

    type: Literal["text"]
    text: str


class Message(_Body):
    """One chat message. ``content`` may be a string or a list of text parts."""

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationParams):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported by the engine model")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("`top_logprobs` must be a positive value.")
        if v is not None and v > MAX_LOGPROBS:
            raise ValueError(
                f"Requested sample logprobs of {v}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}"
            )
        return v

    def check_logprobs(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise RequestError(
                "when using `top_logprobs`, `logprobs` must be set to true.",
                param="top_logprobs",
            )

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tools are not supported by the engine model")
        return v

    def check_generation_prompt(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )

    @property
    def effective_max_tokens(self) -> int | None:
        """vLLM prefers ``max_completion_tokens`` over the deprecated ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` with chat messages."""

    model: str | None = None
    messages: list[Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def validation_error(exc: ValidationError) -> RequestError:
    """A 400 naming the first offending field, with vLLM's ``Bad Request`` type."""
    errors = exc.errors(include_url=False)
    param: str | None = None
    if errors:
        loc = [str(p) for p in errors[0]["loc"] if not isinstance(p, int)]
        # Union members add their type name to loc ("prompt.str"); keep the field path.
        param = loc[0] if loc else None
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else str(err["msg"]))
    message = "; ".join(parts) or str(exc)
    return RequestError(message, param=param, err_type="Bad Request")


_M = TypeVar("_M", bound=BaseModel)


def parse_body(model: type[_M], body: Any) -> _M:
    """Validate ``body`` into ``model``; a 400 ``RequestError`` on failure."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", err_type="Bad Request")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc
