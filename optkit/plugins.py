"""What the method and family registries share: their built-in entries register themselves when
their module is imported, which happens the first time the registry is asked."""

import importlib
from collections.abc import Callable


def import_once(package: str, modules: tuple[str, ...]) -> Callable[[], None]:
    """A function that imports `package.NAME` for each NAME in `modules` on its first call only
    (marked done first: a module that registers itself calls back into the registry)."""
    done = False

    def load() -> None:
        nonlocal done
        if not done:
            done = True
            for name in modules:
                importlib.import_module(f"{package}.{name}")

    return load


def lazy(target: str) -> Callable:
    """The function `module:name`, imported when first called: a registry entry that names its
    torch code this way is declared without importing torch (`optkit quantize` reads every
    method's flags before it checks the model, and a refusal stays instant)."""
    module, name = target.split(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call
