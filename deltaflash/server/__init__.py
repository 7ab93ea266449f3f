"""The OpenAI-compatible server (`deltaflash serve`).

A request's path: `app` (routes, auth) -> `protocol` (body validation) and `frontend` (chat template,
tokenization, context checks), both on the frontend's own thread -> `worker` (the one thread that
calls the engine; stop strings via `textstream`) -> `relay` + `responses` (SSE chunks or one JSON
body). `launcher` builds it all from the flags in `cli` and runs uvicorn; `metrics` and `errors` are
shared by all.
"""
