"""What an RL trainer drives besides generation, with SGLang's endpoint names and fields:
``/update_weights_from_disk``, ``/get_weight_version``, ``/pause_generation``,
``/continue_generation`` and ``/abort_request``. The semantics (what happens to requests in
flight) are ``AsyncEngine``'s: ``update_weights``, ``pause``, ``resume``, ``abort_requests``;
docs/serving.md has them for clients."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI
from pydantic import Field, model_validator

from hyprefix.server.protocol import _Request

if TYPE_CHECKING:
    from hyprefix.server.backend import ServingBackend

CONTROL_PATHS = ("/update_weights_from_disk", "/get_weight_version", "/pause_generation", "/continue_generation",
                 "/abort_request")


class UpdateWeightsFromDiskRequest(_Request):
    model_path: str = Field(min_length=1)  # a checkpoint directory or GGUF file on the server's disk
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    # SGLang's: abort the requests in flight (they return what they have) instead of letting them finish
    abort_all_requests: bool | None = False


class PauseGenerationRequest(_Request):
    mode: Literal["abort", "in_place"] | None = "abort"


class AbortRequest(_Request):
    rid: str | None = Field(None, min_length=1)
    abort_all: bool | None = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give either rid or abort_all: true")
        return self


def add_control_routes(app: FastAPI, backend: ServingBackend, responses: dict[int | str, Any]) -> None:
    """Register the endpoints on ``app`` (``responses``: the documented errors)."""

    @app.post("/update_weights_from_disk", responses=responses)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        result = await backend.update_weights(body.model_path, body.weight_version, bool(body.abort_all_requests))
        return {"success": True, "message": f"updated to weight version {result['weight_version']!r}", **result}

    @app.get("/get_weight_version", responses=responses)
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": await backend.weight_version()}

    @app.post("/pause_generation", responses=responses)
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, Any]:
        mode = (body.mode if body is not None else None) or "abort"
        return {"success": True, "mode": mode, "num_aborted_requests": await backend.pause(mode)}

    @app.post("/continue_generation", responses=responses)
    async def continue_generation() -> dict[str, Any]:
        await backend.resume()
        return {"success": True}

    @app.post("/abort_request", responses=responses)
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        return {"success": True, "num_aborted_requests": await backend.abort(None if body.abort_all else body.rid)}

