"""The OpenAI-compatible HTTP server (`optkit serve`): FastAPI in front of the `AsyncEngine`.

`protocol` holds the request and response models, `chat` turns messages into a prompt,
`responses` formats engine outputs as OpenAI responses and stream chunks, `errors` maps failures
to OpenAI's error body, `metrics` is the Prometheus side and `app` wires the routes.
"""
