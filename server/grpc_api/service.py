"""The `JaxServe` servicer: the HTTP API's engine, keys, limits and accounting, over gRPC.

`Generate` writes each message with `context.write` from one coroutine instead of being an
async generator, so a cancelled call (client gone, deadline) raises `CancelledError` inside
`aclosing(generation.deltas())`, which aborts the request in the engine at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing

import grpc

from server.errors import APIError
from server.generation import EngineRequest
from server.grpc_api import jaxserve_pb2 as pb
from server.grpc_api import jaxserve_pb2_grpc as pb_grpc
from server.grpc_api.inputs import parse_generate
from server.grpc_api.outputs import response_message, usage_message
from server.grpc_api.status import abort
from server.routes_ops import engine_problem
from server.state import ServerState

logger = logging.getLogger(__name__)

ENDPOINT = "grpc"  # the endpoint label of the request metrics
INTERNAL_ERROR = "the server had an internal error while processing the request"


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, state: ServerState) -> None:
        self._state = state

    def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's owner id from `authorization: Bearer <key>` metadata, or APIError 401."""
        metadata = dict(context.invocation_metadata() or ())
        return self._state.keys.authenticate(metadata.get("authorization"))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            await self._generate(request, context)
        except APIError as e:
            await abort(context, e)
        except Exception:
            logger.exception("unhandled error in gRPC Generate")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        arrival = time.perf_counter()
        state = self._state
        owner = self._authenticate(context)
        state.limiter.admit(owner)
        ids, params = parse_generate(request, state.info, state.limits)
        request_id = f"grpc-{uuid.uuid4().hex}"
        with state.admission.hold(params.n):
            generation = state.new_generation(owner, [EngineRequest(request_id, ids, params)], ENDPOINT, arrival)
            finished = 0
            async with aclosing(generation.deltas()) as deltas:
                async for index, delta in deltas:
                    if delta.finished:
                        finished += 1
                    if not (delta.token_ids or delta.text or delta.finished):
                        continue
                    message = response_message(request_id, index, delta)
                    if finished == params.n:  # the call's last message: usage of every choice
                        message.usage.CopyFrom(usage_message(generation.usage))
                    await context.write(message)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        problem = engine_problem(self._state.engine)
        if problem is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING, detail=f"engine: {problem}")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            self._authenticate(context)
        except APIError as e:
            await abort(context, e)
        info = self._state.info
        model = pb.Model(
            id=info.name,
            created=info.created,
            owned_by="jaxserve",
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
        )
        return pb.ListModelsResponse(models=[model])
