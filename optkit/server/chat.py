"""Chat messages -> prompt token ids.

A tokenizer with a `chat_template` renders the messages with it
(`apply_chat_template(..., add_generation_prompt=True)`); the rendered text carries whatever
special tokens the template puts there, so none are added when tokenizing it.

A tokenizer without one (the bundled reference models have none) gets the default template: each
message as a block `<|{role}|>\\n{content}\\n`, then `<|assistant|>\\n` to prompt the reply:

    <|system|>
    You are terse.
    <|user|>
    Hello!
    <|assistant|>

tokenized like a completion prompt (with the tokenizer's usual special tokens).
"""

from optkit.server.protocol import ChatMessage


def default_template(messages: list[ChatMessage]) -> str:
    blocks = [f"<|{m.role}|>\n{m.content or ''}\n" for m in messages]
    return "".join(blocks) + "<|assistant|>\n"


def chat_prompt_text(tokenizer, messages: list[ChatMessage]) -> tuple[str, bool]:
    """The prompt's text, and whether tokenizing it adds special tokens; ValueError when the
    model's template rejects the messages (e.g. a role it does not know)."""
    if not getattr(tokenizer, "chat_template", None):
        return default_template(messages), True
    conversation = [{"role": m.role, "content": m.content or ""} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's TemplateError, or raise_exception() inside the template
        raise ValueError(f"the model's chat template rejected the messages: {e}") from e
    return text, False
