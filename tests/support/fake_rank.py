"""A data-plane rank made of raw sockets, so a test decides exactly what goes on the wire (no torch)."""

from __future__ import annotations

import os
import threading
import time

import zmq

from nanoplane.proto import codec
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult, int32_column


class FakeRank:
    """A rank made of two raw DEALER sockets, so the test decides exactly what goes on the wire."""

    def __init__(self, address: str, launch_id: int, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        self.launch_id, self.rank, self.world_size = launch_id, rank, world_size
        self.beat, self.data = zmq.Socket(zmq.Context.instance(), zmq.DEALER), None
        self.beat.connect(address)
        self.beat.send_multipart(codec.encode_control(codec.Hello(launch_id, rank, world_size, os.getpid())))
        welcome = codec.decode(self.beat.recv_multipart())
        assert isinstance(welcome, codec.Welcome) and welcome.launch_id == launch_id
        self.epoch, self.beating, self.paused = welcome.epoch, True, False
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()
        self.data = zmq.Socket(zmq.Context.instance(), zmq.DEALER)
        self.data.connect(address)
        info = PlaneInfo(rank, world_size, self.epoch, 64, 16, 8, 256, 100, "Fake", device, "float32")
        self.data.send_multipart(codec.encode_control(codec.Ready(launch_id, info)))

    def _beat(self) -> None:
        self.last_reply = None
        while self.beating:
            if not self.paused:
                self.beat.send_multipart(codec.encode_control(codec.Heartbeat(self.launch_id, self.epoch, self.rank)))
            time.sleep(0.1)
            while self.beat.poll(0):
                self.last_reply = codec.decode(self.beat.recv_multipart())

    def answer(self, step_id: int, tokens: list[int], epoch: int | None = None) -> None:
        result = StepResult(step_id, int32_column(tokens))
        self.data.send_multipart(codec.encode_result(result, self.epoch if epoch is None else epoch, self.rank))

    def close(self) -> None:
        self.beating = False
        self.thread.join()
        self.beat.close(0)
        self.data.close(0)


def decode_step(step_id: int, epoch: int) -> StepDescriptor:
    return StepDescriptor(step_id, epoch, slots=int32_column([2]), num_computed=int32_column([9]),
                          num_scheduled=int32_column([1]), appended_offsets=int32_column([0, 0]))
