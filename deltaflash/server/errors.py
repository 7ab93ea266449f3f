"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Each names the offending field in `param` and in its message.
"""

from __future__ import annotations

from deltaflash.errors import DeltaflashError


class ApiError(DeltaflashError):
    status = 400
    type = "invalid_request_error"
    default_code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code or self.default_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
    """Every slot is busy and the admission queue is at its bound (429)."""

    status, type, default_code = 429, "rate_limit_error", "queue_full"


class ServerUnavailable(ApiError):
    """The server is draining for shutdown, or its engine worker has failed (503)."""

    status, type, default_code = 503, "server_error", "unavailable"


class ServerFailure(ApiError):
    status, type, default_code = 500, "server_error", "internal_error"
