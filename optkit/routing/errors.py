"""Why the router cannot place a request. Domain errors: server/errors.py maps each to an HTTP
status and OpenAI's error body, as vLLM's app maps its engine's errors."""


class RoutingError(Exception):
    """A request no served model can take as asked; the message says what to send instead."""


class UnknownModel(RoutingError):
    """The request names a model this process does not serve."""

    def __init__(self, model: str, served: list[str]):
        self.model, self.served = model, served
        shown = ", ".join(repr(n) for n in served)
        super().__init__(f"the model {model!r} does not exist: this server serves {shown}")


class UnknownTier(RoutingError):
    """The tier header names a tier that is not in the tier order."""

    def __init__(self, header: str, tier: str, order: list[str]):
        self.header, self.tier, self.order = header, tier, order
        super().__init__(f"{header} {tier!r} is not a tier: use one of {', '.join(order)}")
