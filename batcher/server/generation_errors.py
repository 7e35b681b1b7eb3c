"""How a generation request's engine trouble reaches its client: a refusal before it ran, a
failure on its last event, its deadline passing."""

from __future__ import annotations

from batcher.core.refusals import DuplicateRequestId, Refused
from batcher.engine.events import EngineEvent
from batcher.http.errors import ApiError, invalid
from batcher.server.protocol import GenerationSpec
from batcher.structured.grammars import GRAMMAR_TOO_COSTLY


def engine_refusal(exc: Exception) -> ApiError:
    """The engine refused a request before running it."""
    if isinstance(exc, DuplicateRequestId):
        return ApiError(409, "request id already in flight", code="duplicate_request_id")
    if isinstance(exc, Refused):
        return invalid(str(exc), exc.param)
    if isinstance(exc, ValueError):
        return invalid(str(exc), None)
    return ApiError(503, f"the engine cannot serve: {exc}", code="engine_error", retry_after=5)


def final_error(ev: EngineEvent) -> ApiError | None:
    """How a choice's last event ends the answer, streamed or whole: an engine failure ("error")
    is a 503 (a status before any byte, an error event after); anything else, "abort" included,
    is a normal end. NOTE: a request cancelled by its owner ends with its partial output and
    finish_reason "abort": an error would make clients, and a router, retry a request nobody
    wants."""
    if ev.finish_reason != "error":
        return None
    if ev.error and ev.error.startswith(GRAMMAR_TOO_COSTLY):  # the request's fault: no retry
        return ApiError(400, ev.error, param="response_format", code="grammar_too_costly")
    return ApiError(503, ev.error or "the engine failed the request", code="engine_error",
                    retry_after=1)


def deadline_error(spec: GenerationSpec) -> ApiError:
    return ApiError(504, f"the request's deadline of {spec.timeout:g}s passed", param="timeout",
                    code="deadline_exceeded")
