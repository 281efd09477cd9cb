"""The Run-output half of RuntimeService (R-OPS-1): a Worker's AppendOutput and an
operator's ReadRunOutput. Translation only, like servicer.py: the decisions are
domain/output.py's, the storage an :class:`~qinglong_control.db.output.OutputStore`.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from qinglong.control.v1 import run_service_pb2
from qinglong.runtime.v1 import runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol import bounds

from qinglong_control import metrics as prometheus
from qinglong_control import wire
from qinglong_control.db.output import OutputStore
from qinglong_control.domain.output import OutputRetention

Context = grpc.aio.ServicerContext[Any, Any]
rt = runtime_service_pb2


class OutputMethods(runtime_service_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, store: OutputStore, retention: OutputRetention) -> None:
        self._output = store
        self._retention = retention

    async def AppendOutput(self, request: rt.AppendOutputRequest, context: Context) -> Any:
        public = request.request
        fence = wire.parse_fence(public.fence)
        wire.worker_of(request.caller, fence.worker_id)
        decision = await self._output.append(fence, public.offset, public.data, self._retention)
        prometheus.OUTPUT_BYTES_STORED.inc(len(decision.write_data))
        return rt.AppendOutputResponse(
            response=worker_service_pb2.AppendOutputResponse(
                end_offset=decision.end_offset, replayed=decision.replayed
            )
        )

    async def ReadRunOutput(self, request: rt.ReadRunOutputRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        page = await self._output.read(
            public.project_id,
            uuid.UUID(public.run_id),
            public.attempt_number if public.HasField("attempt_number") else None,
            public.offset,
            public.max_bytes or bounds.OUTPUT_READ_DEFAULT_BYTES,
        )
        response = run_service_pb2.ReadRunOutputResponse(run_terminal=page.run_terminal)
        if page.attempt_id is not None:
            response.MergeFrom(
                run_service_pb2.ReadRunOutputResponse(
                    attempt_number=page.attempt_number,
                    attempt_id=str(page.attempt_id),
                    log_artifact_id=page.log_artifact_id or "",
                    data=page.data,
                    offset=page.offset,
                    next_offset=page.offset + len(page.data),
                    end_offset=page.end_offset,
                    first_offset=page.first_offset,
                    complete=page.complete,
                    output_bytes=page.output_bytes,
                )
            )
        return rt.ReadRunOutputResponse(response=response)
