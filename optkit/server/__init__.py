"""The OpenAI-compatible HTTP server (`optkit serve`): FastAPI in front of a routing `Router`.

`protocol` holds the request and response models, `chat` turns messages into a prompt,
`responses` formats engine outputs as OpenAI responses and stream chunks, `errors` maps failures
(the router's domain errors included) to status codes and OpenAI's error body, `guards`,
`prompts` and `transport` are the limits on what a client may send, `metrics` and
`routing_metrics` the Prometheus side, `app` wires OpenAI's routes and `optkit_routes` optkit's
own, and `listen` binds the socket and runs uvicorn.
"""
