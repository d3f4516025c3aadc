"""A child process that renders chat templates (`python -m optkit.server.template_worker`).

A model's chat template is a program from someone else. Jinja's sandbox keeps it from reaching
Python's internals, but not from looping for ever (nested `range` loops) or building a huge string,
and a Python thread cannot be stopped. So the server renders templates here, in a process it can
kill (server/template_render.py), with its address space capped (MEMORY_LIMIT_BYTES) and its output
counted as it is produced (a render past `max_chars` stops there).

The environment mirrors transformers' `apply_chat_template` (utils/chat_template_utils.py): an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls, its `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace`, and the `{% generation %}` tag.

Protocol, one JSON object per line each way, after a first line {"ready": true}: in {"template",
"messages", "variables", "max_chars"}; out {"text": ...} or {"error": MESSAGE, "kind": "template" |
"output" | "memory"}. After a memory error the process answers, then exits: the next render gets a
fresh one.
"""

import json
import resource
import signal
import sys
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MEMORY_LIMIT_BYTES = 2 << 30


class OutputTooLong(Exception):
    pass


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it; the
    server renders only the prompt, so the block is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore-prefixed attributes (as transformers')."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env


@lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    return environment().from_string(template)


def render(template: str, messages: list[dict], variables: dict, max_chars: int) -> str:
    """The prompt's text; OutputTooLong past `max_chars` characters, counted while it is produced."""
    context = {"tools": None, "documents": None, **variables, "messages": messages, "add_generation_prompt": True}
    pieces, size = [], 0
    for piece in compiled(template).generate(**context):
        size += len(piece)
        if size > max_chars:
            raise OutputTooLong(f"the model's chat template rendered over {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


def answer(request: dict) -> tuple[dict, bool]:
    """The reply to one request, and whether this process should exit after it."""
    try:
        text = render(request["template"], request["messages"], request["variables"], request["max_chars"])
        return {"text": text}, False
    except OutputTooLong as e:
        return {"error": str(e), "kind": "output"}, False
    except MemoryError:
        return {"error": "the model's chat template ran out of memory", "kind": "memory"}, True
    except RecursionError:
        return {"error": "the model's chat template recursed too deep", "kind": "template"}, False
    except Exception as e:  # TemplateError, raise_exception(), a TypeError inside the template, ...
        return {"error": str(e) or type(e).__name__, "kind": "template"}, False


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which closes our stdin
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        reply, done = answer(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")  # ASCII: lone surrogates travel as escapes
        sys.stdout.flush()
        if done:
            return


if __name__ == "__main__":
    main()
