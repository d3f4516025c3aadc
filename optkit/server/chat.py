"""Chat messages -> prompt token ids.

A tokenizer with a `chat_template` renders the messages with it, as `apply_chat_template(...,
add_generation_prompt=True)` would, but in a worker process under a time and size budget
(server/template_render.py): the template comes with the model, and may never end. The rendered
text carries whatever special tokens the template puts there, so none are added when tokenizing it.

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
from optkit.server.template_render import TemplateRejected, TemplateRenderer


def default_template(messages: list[ChatMessage]) -> str:
    blocks = [f"<|{m.role}|>\n{m.content or ''}\n" for m in messages]
    return "".join(blocks) + "<|assistant|>\n"


def chat_prompt_text(tokenizer, messages: list[ChatMessage], renderer: TemplateRenderer) -> tuple[str, bool]:
    """The prompt's text, and whether tokenizing it adds special tokens; ValueError when the
    model's template rejects the messages (e.g. a role it does not know) or runs past its budget
    (TemplateBudgetExceeded)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return default_template(messages), True
    if isinstance(template, dict):  # named templates: transformers renders "default"
        if "default" not in template:
            raise ValueError(f"the model has chat templates {sorted(template)} but none named 'default'")
        template = template["default"]
    conversation = [{"role": m.role, "content": m.content or ""} for m in messages]
    try:
        text = renderer.render(template, conversation, _template_variables(tokenizer))
    except TemplateRejected as e:
        raise ValueError(f"the model's chat template rejected the messages: {e}") from e
    return text, False


def _template_variables(tokenizer) -> dict:
    """What transformers passes a template besides the messages: the special tokens (bos_token, ...)."""
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    return {
        k: v
        for k, v in special.items()
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))
    }
