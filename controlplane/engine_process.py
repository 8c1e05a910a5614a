"""The engine process's main: what `python -m controlplane.engine_process LAUNCH` runs.

`ProcessFront` (front_process.py, the serving process's side) starts it with a `Launch` (proto/
engine_link.py) as JSON in its command line. It runs an `EngineLoop` whose deliveries go to the
events socket, driven by the commands socket, while the main thread beats. It lives apart from the
serving side because the two never run in one process: the engine process has no use for the gRPC
server or the tokenizer. The design (the two sockets, the beats, what happens when either process
dies) is in front_process.py's docstring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.engine_loop import Delivery, EngineLoop
from nanoplane.controlplane.errors import failure_kind
from nanoplane.controlplane.front import EngineFacts, EngineStats, EngineStatus, Stream
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.process import configure_logging, freeze_startup_objects, terminate
from nanoplane.proto import engine_link as link
from nanoplane.proto.exit_codes import ExitCode

log = logging.getLogger(__name__)

# The main thread sends a beat this often; the serving process kills an engine process it has heard
# nothing from for front_process.ENGINE_SILENCE_S.
BEAT_INTERVAL_S = 1.0


def outputs_event(batch: list[Delivery]) -> link.Outputs:
    """One engine-loop iteration's deliveries as the link's Outputs (the stream ids are the keys)."""
    items: list[link.Delta | link.Failure] = []
    for stream, item in batch:
        if isinstance(item, BaseException):
            items.append(link.Failure(stream.request_id, failure_kind(item), str(item)))
            continue
        reason = item.finish_reason.value if item.finish_reason is not None else None
        logprobs = prompt_logprobs = None
        if item.logprobs is not None:  # only requests that asked pay for the conversion
            logprobs = [link.Logprob(x.token_id, x.logprob, x.rank, x.top) for x in item.logprobs]
        if item.prompt_logprobs is not None:
            prompt_logprobs = [None if x is None else link.Logprob(x.token_id, x.logprob, x.rank, x.top)
                               for x in item.prompt_logprobs]
        items.append(link.Delta(stream.request_id, item.token_ids, item.finished, reason, item.num_prompt_tokens,
                                item.num_completion_tokens, item.num_cached_tokens, item.index, logprobs,
                                prompt_logprobs, item.stop_reason, item.queue_seconds))
    return link.Outputs(items)


def sampling_from_link(s: link.Sampling) -> SamplingParams:
    """The engine's parameters from the link's: the same fields by name (tests/unit/test_engine_link.py)."""
    return SamplingParams(**msgspec.structs.asdict(s))


def readiness_event(ready: bool, facts: EngineFacts | None, reason: str) -> link.Readiness:
    wire = None
    if ready and facts is not None:
        wire = link.Facts(facts.architecture, facts.tensor_parallel_size, facts.max_model_len, facts.vocab_size,
                          facts.block_size, facts.kv_capacity_tokens)
    return link.Readiness(ready, wire, "" if ready else reason)


def status_event(status: EngineStatus) -> link.Status:
    return link.Status(status.running, status.waiting, status.kv_blocks_total, status.kv_blocks_used,
                       status.data_plane_ready)


def stats_event(stats: EngineStats) -> link.Stats:
    return link.Stats(stats.prefix_cache_queries, stats.prefix_cache_hits, stats.preemptions, stats.descriptor_bytes,
                      stats.step_seconds, stats.queue_seconds, stats.epoch, stats.heartbeat_ages)


def engine_main(launch: link.Launch) -> None:
    """The engine process's body: serve the commands until Stop or the serving process's exit."""
    from nanoplane.controlplane.dataplane_client import RemoteDataPlane
    from nanoplane.plane_keys import PlaneKeys

    configure_logging("engine")
    # Ctrl-C reaches the whole process group: the serving process stops this one in order (its
    # open streams first), so the signal itself is not for us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig(**launch.config)
    eos_token_ids = tuple(launch.eos_token_ids)
    parent = os.getppid()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(launch.commands_address)
    events = ctx.socket(zmq.PUSH)  # the engine thread's alone once it runs
    events.setsockopt(zmq.LINGER, 1000)
    events.connect(launch.events_address)
    beats = ctx.socket(zmq.PUSH)  # this (main) thread's own way to the same events socket
    beats.setsockopt(zmq.LINGER, 0)
    beats.connect(launch.events_address)
    beat = link.encode(link.Beat())
    beats.send(beat)
    last_beat = time.monotonic()
    keys = PlaneKeys.control_plane(launch.plane_keys) if launch.plane_keys else None
    data_plane = RemoteDataPlane(launch.data_plane_address, world_size=config.tensor_parallel_size, keys=keys)
    streams: dict[int, Stream] = {}  # key -> stream, for aborts

    def attach(old: Engine | None) -> Engine:
        return Engine(config, data_plane, eos_token_ids, start_timeout=launch.attach_timeout_s)

    def deliver(batch: list[Delivery]) -> None:
        for stream, item in batch:
            if isinstance(item, BaseException) or item.finished:
                streams.pop(stream.request_id, None)
        events.send(link.encode(outputs_event(batch)))

    core = EngineLoop(None, deliver, attach, launch.recover_interval_s,
                      on_status=lambda status: events.send(link.encode(status_event(status))))
    core.add_stats_listener(lambda stats: events.send(link.encode(stats_event(stats))))
    core.set_kv_publisher(lambda timestamp, kv, snapshot: events.send(link.encode(link.KvEvents(timestamp, kv,
                                                                                               snapshot))))
    # The bare reason: ProcessFront.unavailable_message() wraps it in "the data plane is not available (...)".
    core.add_ready_listener(lambda ready: events.send(link.encode(
        readiness_event(ready, core.facts, core.unready_reason))))
    # Objects that live as long as the process (or the engine: the scheduler, the block manager's
    # blocks) go to Python's permanent generation, so that a full collection does not walk them all
    # and stall every stream's step meanwhile; again after each attach, for the new engine's (after
    # collecting what the detached engine left, which a freeze would otherwise keep for good).
    core.add_ready_listener(lambda ready: freeze_startup_objects(thaw_first=True) if ready else None)
    core.start()
    freeze_startup_objects(thaw_first=True)
    orderly = False  # a Stop from the serving process; otherwise it died and the data plane must restart
    try:
        while True:
            if time.monotonic() - last_beat >= BEAT_INTERVAL_S:
                with contextlib.suppress(zmq.Again):
                    beats.send(beat, zmq.NOBLOCK)
                last_beat = time.monotonic()
            if not commands.poll(500):
                if os.getppid() != parent:  # the serving process is gone: nobody to stream to
                    log.warning("the serving process exited; stopping the engine")
                    break
                continue
            try:
                msg = link.decode_command(commands.recv())
            except link.LinkError as exc:  # a request lost here would hang its stream: better to start over
                log.error("stopping the engine: %s", exc)
                break
            if isinstance(msg, link.Add):
                # Here the stream's id is the serving process's key for it, and outputs go to `deliver`.
                s = msg.sampling
                stream = Stream(msg.key, msg.token_ids, None, queue=None)
                if msg.timeout_s is not None:  # the deadline in this process's monotonic clock
                    stream.deadline = time.monotonic() + msg.timeout_s
                streams[msg.key] = stream
                try:
                    stream.params = sampling_from_link(s)
                except ValueError as exc:  # checked by the serving process already; refused, not fatal, here
                    core.fail_stream(stream, exc)
                    continue
                core.add_stream(stream)
            elif isinstance(msg, link.Abort):
                stream = streams.pop(msg.key, None)
                if stream is not None:
                    core.abort_stream(stream, msg.notify)
            elif isinstance(msg, link.StopSample):
                stream = streams.get(msg.key)
                if stream is not None:
                    core.stop_sample(stream, msg.index, msg.stop)
            elif isinstance(msg, link.SetReady):
                core.set_data_plane_ready(msg.ready, msg.reason)
            elif isinstance(msg, link.RecordKvEvents):
                core.record_kv_events(msg.on)
            elif isinstance(msg, link.Flush):  # answered from the engine thread, which sends the outputs too
                core.flush_prefix_cache(lambda ok, token=msg.token: events.send(link.encode(link.Flushed(token, ok))))
            elif isinstance(msg, link.Stop):
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




def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m nanoplane.controlplane.engine_process LAUNCH_JSON (started by the serving process)",
              file=sys.stderr)
        return 2
    try:
        launch = link.decode_launch(argv[0])
    except link.LinkError as exc:
        print(f"nanoplane engine process: {exc}", file=sys.stderr)
        return 2
    engine_main(launch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
