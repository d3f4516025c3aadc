"""optkit's own routes for shadow mode and fallback (under /v1, so an API key guards them), over
the app's `Router` (routing/router.py).

- GET /v1/optkit/shadow: per shadow pair, the rolling window (token-weighted mean KLD, same-top-token
  percent, perplexity ratio), the totals, each recent request's own numbers, and its fallback state.
- GET /v1/optkit/fallback: the fallback state of every pair.
- POST /v1/optkit/fallback/reset: back to the quantized model, for every pair or the one named by
  `{"model": QUANT}` (or `?model=QUANT`); answers which were reset and the states after it.
"""

import json

from fastapi import APIRouter, Request

from optkit.json_strict import finite
from optkit.server.errors import APIError

api = APIRouter()


def _routing(request: Request):
    """The app's `Router`."""
    return request.app.state.served.router


@api.get("/v1/optkit/shadow")
async def shadow(request: Request) -> dict:
    models = _routing(request)
    if models.shadow is None:
        raise APIError(404, "shadow mode is off: start optkit serve with --shadow QUANT=FULL", code="shadow_off")
    return finite(models.shadow.snapshot())  # an empty window's means are NaN: null in JSON


@api.get("/v1/optkit/fallback")
async def fallback(request: Request) -> dict:
    return finite({"pairs": [monitor.state() for monitor in _fallbacks(request).values()]})


@api.post("/v1/optkit/fallback/reset")
async def fallback_reset(request: Request) -> dict:
    monitors = _fallbacks(request)
    model = request.query_params.get("model")
    body = await request.body()
    if body:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            raise APIError(400, 'the body must be JSON: {"model": QUANT}, or empty to reset every pair') from None
        if not isinstance(data, dict) or set(data) - {"model"}:
            raise APIError(400, 'the body takes one key, "model": {"model": QUANT}', param="model")
        model = data.get("model", model)
    if model is not None and model not in monitors:
        pairs = ", ".join(monitors)
        raise APIError(404, f"{model!r} has no fallback: the models with one are {pairs}", param="model")
    targets = [monitors[model]] if model is not None else list(monitors.values())
    reset = [monitor.quant for monitor in targets if monitor.reset()]
    return finite({"reset": reset, "pairs": [monitor.state() for monitor in monitors.values()]})


def _fallbacks(request: Request) -> dict:
    monitors = _routing(request).fallbacks
    if not monitors:
        message = "fallback is off: start optkit serve with --shadow QUANT=FULL --fallback-threshold kld=X"
        raise APIError(404, message, code="fallback_off")
    return monitors
