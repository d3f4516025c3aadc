"""Several models in one server: routing, shadow scoring of a quantized model, and fallback.

`config` is the `serve:` section of a recipe (and the flags that override it), `tiers` and `load`
the pure parts of routing (tier rules, queue waits, prefix affinity), `router` picks the engine of
each request, `online` is the math of online quality (the gate's KLD / same-top-token functions),
`shadow` replays sampled requests on full precision in the background, `fallback` switches traffic
when the online numbers cross a threshold, `metrics` and `routes` expose all of it, and `startup`
turns a `ServeOptions` into running engines and a `Router`.
"""
