"""HTTP errors of the API process, in OpenAI's error shape (also used by /generate)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """Raised anywhere in request handling; turned into a JSON error response once, at the route."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)
