"""OpenAI API request and response bodies: the subset `optkit serve` implements.

Requests are strict, as OpenAI's API is: an unknown parameter, a value of the wrong JSON type
("16" for an integer) or a non-finite number is a 400 that names the parameter. Parameters the
server does not implement are accepted only at their no-op values (n=1, best_of=1, echo=false,
no logit_bias, no suffix). vLLM's extensions top_k, min_p, repetition_penalty, ignore_eos and
stop_token_ids are accepted, and optkit's `speculative` (false: no speculative decoding for this
request, when the server runs with --speculative). Chat messages are lenient (extra keys such as
`name` or `refusal`, which clients echo back from earlier responses, are ignored); their role is not.

Text must be valid Unicode: a lone UTF-16 surrogate ("\\ud800" in the JSON) is a 400. Stop
conditions are capped, as each one costs every generated token something: 4 stop strings (OpenAI's
limit) of at most 256 characters, 128 stop_token_ids.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from optkit.runtime.sequence import SamplingParams

SEED_LIMIT = 2**63  # torch generators take 64-bit seeds
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode: a lone surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}; send UTF-8 text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by completions and chat completions; None means the API's default."""

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-SEED_LIMIT, lt=SEED_LIMIT)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    speculative: bool = True  # optkit's extension

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported: send one request per completion")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict | None) -> dict | None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return [_unicode(s) for s in stops]

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; ValueError (its message names the parameter) when out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            min_p=_default(self.min_p, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            speculative=self.speculative,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
            raise ValueError("batched prompts are not supported: send one prompt (a string or token ids) per request")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty: give some text or token ids")
        return _unicode(prompt) if isinstance(prompt, str) else prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        """OpenAI's content parts: only text parts, joined by newlines."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError('only text content parts are supported: {"type": "text", "text": "..."}')
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# ---- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, and also each chunk of a streamed one (OpenAI uses the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": ...}, {} last
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "optkit"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
