"""Several models in one process: routing, shadow scoring of a quantized model, and fallback. No HTTP.

`config` is the `serve:` section of a recipe, `tiers` and `load` the pure parts of routing (tier
rules, queue waits, prefix affinity), `router` picks the engine of each request and raises the
domain errors of `errors` (server/errors.py gives them their status codes), `online` is the math of
online quality (the gate's KLD / same-top-token functions), `shadow` replays sampled requests on
full precision in the background, `fallback` switches traffic when the online numbers cross a
threshold, and `startup` turns a `ServeOptions` into running engines and a `Router`. The server
exposes all of it (server/optkit_routes.py, server/routing_metrics.py); the CLI merges its flags
into a `ServeOptions` (cli/serve_flags.py).
"""

# The logger of fallback switches and failed replays. Operators filter on this name
# (docs/serving.md), so it stays what it was before the package was renamed from `serving`.
LOGGER = "optkit.serving"
