"""The rank process keeps steps in flight (dataplane/worker.py `_StepLoop`), driven here without a model:
a fake runner whose GPU work takes a number of ticks of a fake clock, and a fake data socket on which
descriptors arrive at given ticks. Every receive that finds nothing lets one tick pass."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from nanoplane.dataplane.model_runner import Launched
from nanoplane.dataplane.worker import _StepLoop
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode
from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT, StepDescriptor, StepResult, int32_column

EPOCH = 3


class Clock:
    now = 0


class Done:
    """A CUDA event stand-in: complete once the clock reaches `at`."""

    def __init__(self, clock: Clock, at: int):
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock.now >= self.at


class FakeRunner:
    def __init__(self, clock: Clock, log: list, gpu_ticks: int | None = 3, refuse=(), explode=(), launch_ticks=0):
        self.clock, self.log, self.gpu_ticks = clock, log, gpu_ticks  # gpu_ticks None: a CPU runner
        self.launch_ticks = launch_ticks  # host time a launch takes before its step is queued
        self.refuse, self.explode = set(refuse), set(explode)
        self.in_flight = self.max_in_flight = 0

    def launch(self, desc: StepDescriptor) -> Launched:
        self.log.append(("launch", desc.step_id))
        self.clock.now += self.launch_ticks
        if desc.step_id in self.explode:
            raise RuntimeError("CUDA error: an illegal memory access")
        if desc.step_id in self.refuse:
            return Launched(desc.step_id, 0.0, error=f"refused step {desc.step_id}")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        done = None if self.gpu_ticks is None else Done(self.clock, self.clock.now + self.gpu_ticks)
        return Launched(desc.step_id, 0.0, host=np.array([100 + desc.step_id], np.int32), done=done)

    def wait(self, launched: Launched) -> StepResult:
        self.log.append(("wait", launched.step_id))
        if launched.error:
            return StepResult(launched.step_id, np.zeros(0, np.int32), error=launched.error)
        self.in_flight -= 1
        if launched.done is not None:
            self.clock.now = max(self.clock.now, launched.done.at)  # a blocking wait lets the GPU finish
        return StepResult(launched.step_id, np.asarray(launched.host, np.int32).copy())


class FakeSocket:
    def __init__(self, clock: Clock, log: list, live: FakeLive, arrivals: list[tuple[int, list]]):
        self.clock, self.log, self.live = clock, log, live
        self.arrivals = sorted(arrivals, key=lambda a: a[0])  # (tick, frames)
        self.sent: list[codec.Result] = []
        self.sent_at: list[int] = []  # the clock at each send

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list:
        if self.arrivals and self.arrivals[0][0] <= self.clock.now:
            return self.arrivals.pop(0)[1]
        if flags & zmq.NOBLOCK:
            self.clock.now += 1
        elif self.arrivals:
            self.clock.now = self.arrivals[0][0]  # a blocking receive sleeps until the next message
            return self.arrivals.pop(0)[1]
        else:
            self.live.request_exit(ExitCode.STOPPED, "the test has nothing more to send")
        raise zmq.Again()

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        result = codec.decode(frames)
        self.sent.append(result)
        self.sent_at.append(self.clock.now)
        self.log.append(("send", result.result.step_id))


class FakeLive:
    def __init__(self):
        self.exit_requested = threading.Event()
        self.exit_code = None

    def request_exit(self, code: int, reason: str) -> None:
        if not self.exit_requested.is_set():
            self.exit_code = code
            self.exit_requested.set()


def step(step_id: int, epoch: int = EPOCH) -> list:
    desc = StepDescriptor(step_id, epoch, slots=int32_column([0]), num_computed=int32_column([4]),
                          num_scheduled=int32_column([1]), appended_offsets=int32_column([0, 0]))
    return codec.encode_descriptor(desc)


def drive(arrivals: list[tuple[int, list]], rank: int = 0, loops: list | None = None, **runner_kw):
    clock, log, live = Clock(), [], FakeLive()
    runner = FakeRunner(clock, log, **runner_kw)
    data = FakeSocket(clock, log, live, arrivals)
    loop = _StepLoop(runner, data, EPOCH, rank)
    if loops is not None:
        loops.append(loop)
    loop.run(live)
    return log, data, runner, live


def test_queued_step_is_launched_before_the_previous_result_is_sent():
    log, data, runner, _ = drive([(0, step(0)), (0, step(1))])
    assert log == [("launch", 0), ("launch", 1), ("wait", 0), ("send", 0), ("wait", 1), ("send", 1)]
    assert [r.result.sampled_token_ids.tolist() for r in data.sent] == [[100], [101]]
    assert runner.max_in_flight == 2


def test_step_arriving_while_the_gpu_runs_is_launched_first():
    log, _, _, _ = drive([(0, step(0)), (1, step(1))], gpu_ticks=3)
    assert log[:4] == [("launch", 0), ("launch", 1), ("wait", 0), ("send", 0)]


def test_finished_result_is_sent_at_once_without_waiting_for_the_next_descriptor():
    log, data, _, _ = drive([(0, step(0)), (50, step(1))], gpu_ticks=3)
    assert log == [("launch", 0), ("wait", 0), ("send", 0), ("launch", 1), ("wait", 1), ("send", 1)]
    assert data.sent_at == [3, 53]  # as soon as the event completes


def test_a_cpu_step_is_answered_before_the_next_launch():
    """On a CPU the launch computed the step: its result never waits for the next step's compute."""
    log, _, _, _ = drive([(0, step(0)), (0, step(1))], gpu_ticks=None)
    assert log == [("launch", 0), ("wait", 0), ("send", 0), ("launch", 1), ("wait", 1), ("send", 1)]


def test_two_steps_sent_ahead_are_launched_before_the_oldest_result_and_no_more():
    """A control plane two steps ahead: three steps launched while the first runs; a fourth, already
    queued, waits for the oldest result (the runner's pinned result ring holds three)."""
    log, data, runner, _ = drive([(0, step(s)) for s in range(4)], gpu_ticks=5)
    assert MAX_STEPS_IN_FLIGHT == 2
    assert log[:5] == [("launch", 0), ("launch", 1), ("launch", 2), ("wait", 0), ("send", 0)]
    assert log.index(("launch", 3)) > log.index(("send", 0))
    assert runner.max_in_flight == 3
    assert [r.result.sampled_token_ids.tolist() for r in data.sent] == [[100], [101], [102], [103]]


def test_pace_reads_the_control_planes_depth_off_the_traffic():
    from nanoplane.dataplane.worker import _Pace

    pace = _Pace(rank=0, every=1000)
    for s in (0, 1, 2):  # a burst fills the pipeline: three descriptors before any result
        pace.received(s)
    assert pace.depth == 2 and pace.turnaround == []
    pace.sent_result(0)
    pace.received(3)  # step 3 came after result 0: the turnaround counts from there
    assert len(pace.turnaround) == 1 and pace.dry == 0


def test_refusals_keep_their_place_and_at_most_three_steps_are_launched():
    arrivals = [(0, step(0)), (0, step(1, epoch=EPOCH + 1)), (0, step(2)), (0, step(3)), (0, step(4))]
    log, data, runner, _ = drive(arrivals, refuse={2})
    assert [r.result.step_id for r in data.sent] == [0, 1, 2, 3, 4]
    errors = [r.result.error for r in data.sent]
    assert errors[0] == errors[3] == errors[4] == ""
    assert "refused: descriptor of epoch 4" in errors[1] and errors[2] == "refused step 2"
    assert [r.result.sampled_token_ids.tolist() for r in data.sent] == [[100], [], [], [103], [104]]
    assert ("launch", 1) not in log  # another epoch's descriptor never reaches the runner
    assert runner.max_in_flight <= MAX_STEPS_IN_FLIGHT + 1
    assert not any(r.fatal for r in data.sent)


@pytest.mark.parametrize("rank", [0, 1])
def test_runner_exception_sends_a_fatal_result_and_raises(rank):
    clock, log, live = Clock(), [], FakeLive()
    data = FakeSocket(clock, log, live, [(0, step(0)), (0, step(1))])
    loop = _StepLoop(FakeRunner(clock, log, explode={1}), data, EPOCH, rank)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop.run(live)
    fatal = [r for r in data.sent if r.fatal]
    assert len(fatal) == 1 and fatal[0].result.step_id == 1 and f"rank {rank} failed" in fatal[0].result.error
    assert data.sent[-1] is fatal[0]


def test_other_ranks_execute_in_order_and_answer_nothing():
    log, data, _, _ = drive([(0, step(0)), (0, step(1, epoch=EPOCH + 1)), (0, step(2)), (0, step(3))],
                            rank=1, refuse={3})
    assert data.sent == []
    assert [e for e in log if e[0] == "launch"] == [("launch", 0), ("launch", 2), ("launch", 3)]
    assert [e for e in log if e[0] == "wait"] == [("wait", 0), ("wait", 2), ("wait", 3)]


def test_shutdown_and_malformed_messages():
    shutdown = codec.encode_control(codec.Shutdown(ExitCode.STOPPED, "done"))
    log, data, _, live = drive([(0, [b"garbage"]), (0, step(0)), (10, shutdown), (20, step(1))])
    assert live.exit_code == ExitCode.STOPPED
    assert [r.result.step_id for r in data.sent] == [0]
    assert ("launch", 1) not in log


def test_pace_counts_turnaround_and_the_descriptors_the_gpu_waited_for(caplog):
    from nanoplane.dataplane.worker import _Pace

    pace = _Pace(rank=0, every=4)
    # Steady pipeline: descriptor s + 1 arrives after result s - 1 went out, before result s.
    pace.sent_result(0)
    pace.received(2)
    pace.launched(0.001, False)
    # The GPU ran dry: result 2 went out before descriptor 3 came.
    pace.sent_result(1)
    pace.sent_result(2)
    pace.received(3)
    pace.launched(0.001, False)
    assert len(pace.turnaround) == 2 and pace.dry == 1 and pace.late == 0
    # After an idle spell a new burst's first descriptor is not a turnaround, though it counts as a
    # descriptor the GPU waited for (it had nothing queued).
    pace.sent[3] = pace.sent[2] = 0.0  # results sent long ago
    pace.received(4)
    pace.launched(0.001, True)  # and the step before had finished by the time this launch ended
    assert len(pace.turnaround) == 2 and pace.dry == 2 and pace.late == 1
    with caplog.at_level("INFO", logger="nanoplane.dataplane"):
        pace.launched(0.001, False)
    assert "last 4 steps" in caplog.text and "GPU waited for 2 descriptors and 1 launches" in caplog.text
    assert pace.launch == [] and pace.turnaround == [] and pace.dry == 0 and pace.late == 0


@pytest.mark.parametrize("launch_ticks,late", [(0, 0), (5, 1)])
def test_pace_counts_launches_that_end_after_the_previous_step_finished(monkeypatch, launch_ticks, late):
    """Step 1 arrives while step 0 runs (3 ticks); a 5-tick launch of it ends after step 0 is done."""
    monkeypatch.setenv("NANOPLANE_RANK_PACE", "1000")
    loops = []
    drive([(0, step(0)), (1, step(1))], gpu_ticks=3, loops=loops, launch_ticks=launch_ticks)
    pace = loops[0].pace
    assert pace.late == late and len(pace.launch) == 2
