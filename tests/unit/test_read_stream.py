"""front.read_stream: a consumer that fell behind gets one output per sample (each sample's tokens and
logprobs merged in order), the stream ends once each of the request's n samples has finished, and an
error queued after outputs is raised after them."""

from __future__ import annotations

import asyncio

import pytest

from nanoplane.controlplane.front import Output, Stream, read_stream
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob


def _lp(token: int) -> Logprob:
    return Logprob(token, -1.0, 1, [(token, -1.0)])


async def _read(stream: Stream) -> list[Output]:
    return [out async for out in read_stream(stream)]


def test_a_late_reader_gets_one_output_per_sample_and_the_stream_ends_after_the_last():
    async def main() -> list[Output]:
        stream = Stream("r", [1, 2], SamplingParams(n=2, logprobs=0))
        for out in (Output("r", [5], index=0, logprobs=[_lp(5)]), Output("r", [7], index=1, logprobs=[_lp(7)]),
                    Output("r", [6], True, FinishReason.LENGTH, index=0, logprobs=[_lp(6)]),
                    Output("r", [8], index=1, logprobs=[_lp(8)])):
            stream.queue.put_nowait(out)
        reader = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(0.01)
        assert not reader.done()  # sample 1 has not finished yet
        stream.queue.put_nowait(Output("r", [9], True, FinishReason.STOP, index=1, stop_reason=9))
        return await asyncio.wait_for(reader, 5)

    first, second, last = asyncio.run(main())
    assert (first.index, first.token_ids, first.finished) == (0, [5, 6], True)
    assert [lp.token_id for lp in first.logprobs] == [5, 6]
    assert (second.index, second.token_ids, second.finished) == (1, [7, 8], False)
    assert (last.index, last.token_ids, last.finish_reason, last.stop_reason) == (1, [9], FinishReason.STOP, 9)


def test_an_error_is_raised_after_the_outputs_before_it():
    async def main() -> list[Output]:
        stream = Stream("r", [1], SamplingParams())
        stream.queue.put_nowait(Output("r", [5]))
        stream.queue.put_nowait(ValueError("lost"))
        got: list[Output] = []
        with pytest.raises(ValueError, match="lost"):
            async for out in read_stream(stream):
                got.append(out)
        return got

    assert [out.token_ids for out in asyncio.run(main())] == [[5]]
