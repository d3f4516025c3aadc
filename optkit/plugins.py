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
