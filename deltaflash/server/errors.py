"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Each names the offending field in `param` and in its message. 429 and 503 carry `Retry-After`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from deltaflash.errors import DeltaflashError


class ApiError(DeltaflashError):
    status = 400
    type = "invalid_request_error"
    default_code: str | None = None
    retry_after: int | None = None  # seconds, sent as the Retry-After header

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code or self.default_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class BadRequest(ApiError):
    """The body is malformed or a field has a wrong type or value (400)."""


class Unauthorized(ApiError):
    status, default_code = 401, "invalid_api_key"


class NotFound(ApiError):
    status, default_code = 404, "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class PayloadTooLarge(ApiError):
    status, default_code = 413, "payload_too_large"


class QueueFull(ApiError):
    """Every slot is busy and the admission queue is at its bound (429). A slot frees whenever a
    request finishes, so a retry soon may find one."""

    status, type, default_code, retry_after = 429, "rate_limit_error", "queue_full", 1


class ServerUnavailable(ApiError):
    """The server is draining for shutdown, its engine worker has failed (503), or it shut down before
    the request finished (code "server_shutdown")."""

    status, type, default_code, retry_after = 503, "server_error", "unavailable", 5


class ServerFailure(ApiError):
    status, type, default_code = 500, "server_error", "internal_error"
