"""Conversions between the controller's dataclasses and the ``ProfilerControl`` protobuf messages."""

from __future__ import annotations

from zoomer_serve.profiling import profiler_control_pb2 as pb
from zoomer_serve.profiling.config import SessionOptions
from zoomer_serve.profiling.session import ControlReply, Result, SessionInfo, State

_CUDA_TO_PB = {None: pb.StartRequest.CUDA_AUTO, True: pb.StartRequest.CUDA_ON, False: pb.StartRequest.CUDA_OFF}
_CUDA_FROM_PB = {v: k for k, v in _CUDA_TO_PB.items()}
_STATE_TO_PB = {State.IDLE: pb.IDLE, State.ARMED: pb.ARMED, State.RUNNING: pb.RUNNING, State.WRITING: pb.WRITING}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_RESULT_TO_PB = {result: pb.ControlReply.Result.Value(result.name) for result in Result}
_RESULT_FROM_PB = {v: k for k, v in _RESULT_TO_PB.items()}


def start_request(options: SessionOptions, trigger: str) -> pb.StartRequest:
    return pb.StartRequest(max_requests=options.max_requests or 0, duration_ms=options.duration_ms or 0,
                           cuda=_CUDA_TO_PB[options.cuda], record_shapes=options.record_shapes,
                           profile_memory=options.profile_memory, with_stack=options.with_stack,
                           with_flops=options.with_flops, trigger=trigger)


def options_from(request: pb.StartRequest) -> SessionOptions:
    """0 bounds mean "not given"."""
    return SessionOptions(max_requests=request.max_requests or None, duration_ms=request.duration_ms or None,
                          cuda=_CUDA_FROM_PB.get(request.cuda), record_shapes=request.record_shapes,
                          profile_memory=request.profile_memory, with_stack=request.with_stack,
                          with_flops=request.with_flops)


def session_to_pb(info: SessionInfo) -> pb.Session:
    msg = pb.Session(number=info.number, session_id=info.session_id, trigger=info.trigger,
                     state=_STATE_TO_PB[info.state], outcome=info.outcome or "", error=info.error or "",
                     max_requests=info.max_requests, duration_ms=info.duration_ms, cuda=info.cuda,
                     requests=info.requests, stop_reason=info.stop_reason or "",
                     start_time_unix_nano=info.start_time_unix_nano, end_time_unix_nano=info.end_time_unix_nano,
                     trace_path=info.trace_path or "", trace_bytes=info.trace_bytes,
                     kernel_count=info.kernel_count, kernel_time_us=info.kernel_time_us,
                     requests_incomplete=info.requests_incomplete)
    if info.attributed_share is not None:
        msg.attributed_share = info.attributed_share
    return msg


def session_from_pb(msg: pb.Session) -> SessionInfo:
    return SessionInfo(
        number=msg.number, session_id=msg.session_id, trigger=msg.trigger,
        state=_STATE_FROM_PB.get(msg.state, State.IDLE), max_requests=msg.max_requests,
        duration_ms=msg.duration_ms, cuda=msg.cuda, outcome=msg.outcome or None, error=msg.error or None,
        requests=msg.requests, stop_reason=msg.stop_reason or None,
        start_time_unix_nano=msg.start_time_unix_nano, end_time_unix_nano=msg.end_time_unix_nano,
        trace_path=msg.trace_path or None, trace_bytes=msg.trace_bytes, kernel_count=msg.kernel_count,
        kernel_time_us=msg.kernel_time_us,
        attributed_share=msg.attributed_share if msg.HasField("attributed_share") else None,
        requests_incomplete=msg.requests_incomplete)


def reply_to_pb(reply: ControlReply) -> pb.ControlReply:
    msg = pb.ControlReply(result=_RESULT_TO_PB[reply.result], state=_STATE_TO_PB[reply.state],
                          message=reply.message)
    if reply.session is not None:
        msg.session.CopyFrom(session_to_pb(reply.session))
    if reply.last is not None:
        msg.last.CopyFrom(session_to_pb(reply.last))
    return msg


def reply_from_pb(msg: pb.ControlReply) -> ControlReply:
    return ControlReply(
        result=_RESULT_FROM_PB.get(msg.result, Result.STATUS), state=_STATE_FROM_PB.get(msg.state, State.IDLE),
        message=msg.message, session=session_from_pb(msg.session) if msg.HasField("session") else None,
        last=session_from_pb(msg.last) if msg.HasField("last") else None)
