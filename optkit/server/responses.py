"""Engine outputs -> OpenAI responses, whole or as server-sent events.

A stream is `data: {json}\\n\\n` events and a final `data: [DONE]\\n\\n`. Completions send each
output's new text as a `text_completion` chunk, the last one with its finish_reason. Chat sends
`delta: {"role": "assistant", "content": ""}` first, then `delta: {"content": ...}` chunks, then
`delta: {}` with the finish_reason. With `stream_options.include_usage`, every chunk carries
`"usage": null` and a last chunk with no choices carries the usage. An engine failure mid-stream
(after the 200 was sent) is an `data: {"error": ...}` event before `[DONE]`, without the exception's
text (which goes to the log).
"""

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from optkit.server.errors import logger
from optkit.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

DONE = "data: [DONE]\n\n"


@dataclass
class Reply:
    """What every response of one request shares."""

    id: str
    created: int
    model: str
    tokenizer: object
    logprobs: bool  # the client asked for logprobs
    include_usage: bool = False


@dataclass
class Collected:
    text: str = ""
    logprobs: list = field(default_factory=list)  # TokenLogprobs (runtime/sampler.py)
    last: object = None  # the final RequestOutput


async def collect(first, outputs: AsyncIterator) -> Collected:
    """Every output of a request, the engine's stream closed on the way out."""
    result = Collected()
    async with aclosing(outputs):
        output = first
        while True:
            result.text += output.text
            result.logprobs += output.logprobs or []
            result.last = output
            if output.finished:
                return result
            output = await anext(outputs)


def usage(output) -> Usage:
    return Usage(
        prompt_tokens=output.num_prompt_tokens,
        completion_tokens=output.num_output_tokens,
        total_tokens=output.num_prompt_tokens + output.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, entries: list, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; `offset` is where the first token's text starts in the completion."""
    result = CompletionLogprobs()
    for entry in entries:
        token = _token(tokenizer, entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({_token(tokenizer, t): lp for t, lp in entry.top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(tokenizer, entries: list) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = _token(tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)


def completion_response(reply: Reply, done: Collected) -> CompletionResponse:
    logprobs = completion_logprobs(reply.tokenizer, done.logprobs, 0) if reply.logprobs else None
    choice = CompletionChoice(text=done.text, logprobs=logprobs, finish_reason=done.last.finish_reason)
    return CompletionResponse(
        id=reply.id, created=reply.created, model=reply.model, choices=[choice], usage=usage(done.last)
    )


def chat_response(reply: Reply, done: Collected) -> ChatCompletionResponse:
    logprobs = chat_logprobs(reply.tokenizer, done.logprobs) if reply.logprobs else None
    choice = ChatChoice(
        message=AssistantMessage(content=done.text), logprobs=logprobs, finish_reason=done.last.finish_reason
    )
    return ChatCompletionResponse(
        id=reply.id, created=reply.created, model=reply.model, choices=[choice], usage=usage(done.last)
    )


def _event(reply: Reply, chunk) -> str:
    exclude = None if reply.include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def _error_event(error: Exception) -> str:
    logger.error("the engine failed mid-stream", exc_info=error)
    message = "the engine failed while generating: the server's log has the details"
    body = ErrorResponse(error=ErrorDetail(message=message, type="server_error", code="500"))
    return f"data: {body.model_dump_json()}\n\n"


async def _until_finished(first, outputs: AsyncIterator) -> AsyncIterator:
    """`first`, then the engine's outputs up to the finished one; `outputs` is closed when the
    stream is (a client that went away aborts its request)."""
    async with aclosing(outputs):
        output = first
        while True:
            yield output
            if output.finished:
                return
            output = await anext(outputs)


async def completion_events(reply: Reply, first, outputs: AsyncIterator) -> AsyncIterator[str]:
    offset, output = 0, first
    try:
        async with aclosing(_until_finished(first, outputs)) as stream:
            async for output in stream:
                logprobs = None
                if reply.logprobs and output.logprobs:
                    logprobs = completion_logprobs(reply.tokenizer, output.logprobs, offset)
                    offset += sum(len(t) for t in logprobs.tokens)
                if output.text or output.finished or logprobs:
                    choice = CompletionChoice(text=output.text, logprobs=logprobs, finish_reason=output.finish_reason)
                    yield _event(reply, CompletionResponse(**_ids(reply), choices=[choice]))
    except Exception as error:  # the engine failed after the 200 went out
        yield _error_event(error)
        yield DONE
        return
    if reply.include_usage:
        yield _event(reply, CompletionResponse(**_ids(reply), choices=[], usage=usage(output)))
    yield DONE


async def chat_events(reply: Reply, first, outputs: AsyncIterator) -> AsyncIterator[str]:
    def chunk(delta: dict, logprobs: ChatLogprobs | None = None, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return _event(reply, ChatCompletionChunk(**_ids(reply), choices=[choice]))

    yield chunk({"role": "assistant", "content": ""})
    output = first
    try:
        async with aclosing(_until_finished(first, outputs)) as stream:
            async for output in stream:
                logprobs = None
                if reply.logprobs and output.logprobs:
                    logprobs = chat_logprobs(reply.tokenizer, output.logprobs)
                if output.text or logprobs:
                    yield chunk({"content": output.text}, logprobs)
    except Exception as error:
        yield _error_event(error)
        yield DONE
        return
    yield chunk({}, finish_reason=output.finish_reason)
    if reply.include_usage:
        yield _event(reply, ChatCompletionChunk(**_ids(reply), choices=[], usage=usage(output)))
    yield DONE


def _ids(reply: Reply) -> dict:
    return {"id": reply.id, "created": reply.created, "model": reply.model}
