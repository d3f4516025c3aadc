"""A request's prompt -> a router `Prompt`: how it is tokenized for each engine's tokenizer.

Tokenizing runs in the app's thread pool (app.py), and is bounded by the context limit `limit`
(the longest served context) before it is proportional to the prompt's size:
- token ids: more ids than `limit` are refused before anything looks at them;
- text (a prompt, or chat messages rendered by their template): a text longer than
  PROBE_CHARS_PER_TOKEN characters per context token is first tokenized only that far; when that
  head alone takes more than `limit` + PROBE_MARGIN tokens, the prompt is refused without
  tokenizing the rest. A text's tokens are local (the tokens of a head are those of the whole text
  but for the last few), so the margin keeps a prompt that fits from being refused. No count of
  characters alone bounds the tokens (one token may span many characters), so a text that passes
  the probe is tokenized whole: that work is bounded by the body's size cap (guards.py).
"""

from optkit.routing.router import Prompt
from optkit.server.chat import chat_prompt_text
from optkit.server.errors import APIError
from optkit.server.protocol import ChatMessage
from optkit.server.template_render import TemplateRenderer

PROBE_CHARS_PER_TOKEN = 16
PROBE_MARGIN = 16


def refuse_length(num_tokens: int, limit: int, param: str, at_least: bool = False) -> None:
    verb = "take" if param == "messages" else "has"
    count = f"more than {num_tokens}" if at_least else str(num_tokens)
    message = (
        f"the {param} {verb} {count} tokens, which leaves no room to reply within the context limit "
        f"of {limit} tokens: shorten it"
    )
    raise APIError(400, message, param=param, code="context_length_exceeded")


def encode_within(tokenizer, text: str, limit: int, param: str, **kwargs) -> list[int]:
    probe = PROBE_CHARS_PER_TOKEN * limit
    if len(text) > probe:
        head = tokenizer.encode(text[:probe], **kwargs)
        if len(head) > limit + PROBE_MARGIN:
            refuse_length(len(head) - PROBE_MARGIN, limit, param, at_least=True)
    return tokenizer.encode(text, **kwargs)


def completion_prompt(prompt: str | list[int], limit: int) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(encode=lambda tokenizer: encode_within(tokenizer, prompt, limit, "prompt"), text=lambda _: prompt)
    if len(prompt) >= limit:
        refuse_length(len(prompt), limit, "prompt")
    return Prompt(encode=lambda tokenizer: list(prompt), text=lambda tokenizer: _decode(tokenizer, prompt))


def chat_prompt(messages: list[ChatMessage], limit: int, renderer: TemplateRenderer) -> Prompt:
    def encode(tokenizer) -> list[int]:
        try:
            text, add_special_tokens = chat_prompt_text(tokenizer, messages, renderer)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return encode_within(tokenizer, text, limit, "messages", add_special_tokens=add_special_tokens)

    return Prompt(encode=encode, text=lambda tokenizer: "\n".join(m.content or "" for m in messages))


def _decode(tokenizer, token_ids: list[int]) -> str:
    vocab_size = len(tokenizer)
    return tokenizer.decode([t for t in token_ids if 0 <= t < vocab_size])
