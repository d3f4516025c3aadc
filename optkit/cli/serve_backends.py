"""`optkit serve --backend NAME=URL`: OpenAI-compatible upstreams (a vLLM server, another optkit)
served as models beside the in-process ones (upstream/engine.py, docs/serving.md "Upstreams").

Only the command line names them: where prompts go, and the key sent there, are never a file's to
say (`serve.backends` in a recipe is refused). The upstream's key is read from the environment
variable `--backend-key NAME=ENVVAR` names (a key on the command line would show in `ps`;
routing/startup.py reads it).
"""

from optkit.errors import OptkitError


def backends_section(flags) -> dict:
    """`serve.backends` from the flags (`flags`: cli/serve_flags.py's ServeFlags)."""
    from optkit.cli.serve_flags import parse_pairs

    backends = {name: {"url": url} for name, url in parse_pairs(flags.backends, "--backend", "URL").items()}
    per_upstream = [
        (flags.backend_key, "--backend-key", "key_env", str),
        (flags.backend_tokenizer, "--backend-tokenizer", "tokenizer", str),
        (flags.backend_concurrency, "--backend-concurrency", "max_concurrency", int),
    ]
    for values, flag, key, convert in per_upstream:
        for name, value in parse_pairs(values, flag).items():
            if name not in backends:
                raise OptkitError(f"{flag} {name}={value}: no --backend {name}=URL is given")
            try:
                backends[name][key] = convert(value)
            except ValueError:
                raise OptkitError(f"{flag} {name}={value}: {value!r} is not a whole number") from None
    if flags.backend_timeout is not None:
        for spec in backends.values():
            spec["timeout_s"] = flags.backend_timeout
    return backends
