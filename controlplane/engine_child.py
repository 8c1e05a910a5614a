"""The engine process's side of `engine_process.py`: the function a spawned child runs, and what it sends.

`engine_main` runs in the child that `EngineClient` (engine_process.py) spawns: an `AsyncEngine`
whose deliveries go to the events socket, driven by the commands socket, while the main thread
beats. It lives apart from the serving process's side because the two never run in one process:
multiprocessing's spawn imports this module in the child by its name, and the child has no use for
the client, the gRPC server or the tokenizer that engine_process.py imports. What the child sends is
defined here too, for the serving process to read: `EngineFacts`, and outputs packed as tuples
(`pack_output`, `unpack_output`). The design (the two sockets, the beats, what happens when either
process dies) is in engine_process.py's docstring.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass

import zmq

from controlplane.async_engine import AsyncEngine
from controlplane.config import EngineConfig
from controlplane.engine import Engine, validate_request
from controlplane.sampling_params import SamplingParams
from controlplane.sequence import FinishReason
from controlplane.stream import Output, Stream
from proto.plane import PlaneInfo

log = logging.getLogger(__name__)

# The main thread sends a beat this often; the serving process kills an engine process it has heard
# nothing from for engine_process.ENGINE_SILENCE_S.
BEAT_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the serving process knows of the attached engine: enough to check a request before it is
    sent and to answer GetModelInfo."""

    infos: tuple[PlaneInfo, ...]  # each rank's handshake
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_capacity_tokens: int

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        return cls(tuple(engine.infos), engine.max_model_len, engine.vocab_size, engine.block_size,
                   engine.kv_capacity_tokens)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_request(token_ids, params, self.vocab_size, self.max_model_len, self.kv_capacity_tokens)


def pack_output(out: Output) -> tuple:
    # A tuple pickles about ten times faster than the dataclass (256 of them a step).
    reason = out.finish_reason.value if out.finish_reason is not None else None
    return (out.token_ids, out.finished, reason, out.num_prompt_tokens, out.num_completion_tokens,
            out.num_cached_tokens)


def unpack_output(request_id: str, packed: tuple) -> Output:
    """pack_output's inverse, in the serving process (the request id travels beside the tuple)."""
    token_ids, finished, reason, num_prompt, num_completion, num_cached = packed
    return Output(request_id, token_ids, finished, FinishReason(reason) if reason is not None else None,
                  num_prompt, num_completion, num_cached)


def engine_main(config: EngineConfig, data_plane_address: str, commands_address: str, events_address: str,
                eos_token_ids: tuple[int, ...], recover_interval_s: float, attach_timeout_s: float) -> None:
    """The engine process's body: serve the commands until "stop" or the serving process's exit."""
    from controlplane.dataplane_client import RemoteDataPlane
    from nanoplane.process import terminate
    from proto.exit_codes import ExitCode

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group: the serving process stops this one in order (its
    # open streams first), so the signal itself is not for us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(commands_address)
    events = ctx.socket(zmq.PUSH)  # the engine thread's alone once it runs
    events.setsockopt(zmq.LINGER, 1000)
    events.connect(events_address)
    beats = ctx.socket(zmq.PUSH)  # this (main) thread's own way to the same events socket
    beats.setsockopt(zmq.LINGER, 0)
    beats.connect(events_address)
    beats.send_pyobj(("beat",))
    last_beat = time.monotonic()
    data_plane = RemoteDataPlane(data_plane_address, world_size=config.tensor_parallel_size)
    streams: dict[int, Stream] = {}  # key -> stream, for aborts

    def attach(old: Engine | None) -> Engine:
        return Engine(config, data_plane, eos_token_ids, start_timeout=attach_timeout_s)

    def deliver(batch: list) -> None:
        out = []
        for stream, item in batch:
            if isinstance(item, BaseException):
                streams.pop(stream.request_id, None)
                out.append((stream.request_id, item))
                continue
            if item.finished:
                streams.pop(stream.request_id, None)
            out.append((stream.request_id, pack_output(item)))
        events.send_pyobj(("out", out), protocol=pickle.HIGHEST_PROTOCOL)

    core = AsyncEngine(None, attach, recover_interval_s, deliver=deliver,
                       on_status=lambda status: events.send_pyobj(("status", status)))
    # The bare reason: EngineClient.unavailable_message() wraps it in "the data plane is not available (...)".
    core.add_ready_listener(lambda ready: events.send_pyobj(
        ("ready", ready, EngineFacts.of(core.engine) if ready else None, core.unready_reason)))
    # Objects that live as long as the process (or the engine: the scheduler, the block manager's
    # blocks) go to Python's permanent generation, so that a full collection does not walk them all
    # and stall every stream's step meanwhile; again after each attach, for the new engine's (after
    # collecting what the detached engine left, which a freeze would otherwise keep for good).
    core.add_ready_listener(lambda ready: _freeze_startup_objects() if ready else None)
    core.start()
    _freeze_startup_objects()
    orderly = False  # a "stop" from the serving process; otherwise it died and the data plane must restart
    try:
        while True:
            if time.monotonic() - last_beat >= BEAT_INTERVAL_S:
                with contextlib.suppress(zmq.Again):
                    beats.send_pyobj(("beat",), zmq.NOBLOCK)
                last_beat = time.monotonic()
            if not commands.poll(500):
                if os.getppid() != parent:  # the serving process is gone: nobody to stream to
                    log.warning("the serving process exited; stopping the engine")
                    break
                continue
            msg = commands.recv_pyobj()
            if msg[0] == "add":
                _, key, token_ids, params = msg
                # Here the stream's id is the serving process's key for it, and outputs go to `deliver`.
                stream = Stream(key, token_ids, params, queue=None)
                streams[key] = stream
                core.add_stream(stream)
            elif msg[0] == "abort":
                stream = streams.pop(msg[1], None)
                if stream is not None:
                    core.abort_stream(stream, msg[2])
            elif msg[0] == "ready":
                core.set_data_plane_ready(msg[1], msg[2])
            elif msg[0] == "stop":
                orderly = True
                break
    finally:
        if not orderly:  # the serving process died: no planned stop, so the data plane must come back
            data_plane.close(exit_code=ExitCode.RESTART)  # before core.shutdown, whose engine.close() says 0
        core.shutdown()  # open streams end with UNAVAILABLE; their outputs still go out
        data_plane.close()
        events.close()
        beats.close()
        commands.close(linger=0)
        terminate(ctx, "engine")


def _freeze_startup_objects() -> None:
    gc.unfreeze()
    gc.collect()
    gc.freeze()
