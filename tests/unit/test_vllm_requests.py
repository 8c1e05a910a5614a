"""vllm.grpc.engine's request fields in nanoplane's terms, and KV-cache events as SubscribeKvEvents
sends them (controlplane/vllm_requests.py, vllm_kv_events.py); over gRPC: tests/service/test_vllm_grpc.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from nanoplane.controlplane.front import EngineFacts
from nanoplane.controlplane.vllm_kv_events import batch_to_proto, relay
from nanoplane.controlplane.vllm_requests import sampling_from_vllm, truncate_prompt
from nanoplane.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

FACTS = EngineFacts("LlamaForCausalLM", 1, max_model_len=256, vocab_size=1000, block_size=16, kv_capacity_tokens=200)


def test_unset_fields_take_vllms_defaults():
    params = sampling_from_vllm(vpb.SamplingParams(), num_prompt_tokens=10, facts=FACTS)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.n) == (1.0, 1.0, 1.0, 1)
    assert params.max_tokens == 190  # what the lesser of the context and the KV cache leaves
    assert params.logprobs is None and params.prompt_logprobs is None and params.seed is None
    assert params.structured is None


def test_set_fields_are_carried():
    sp = vpb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5,
                            presence_penalty=-0.5, repetition_penalty=1.2, max_tokens=7, min_tokens=2,
                            stop=["x"], stop_token_ids=[3], ignore_eos=True, n=3, logprobs=2, prompt_logprobs=0,
                            seed=-1, include_stop_str_in_output=True, logit_bias={4: 2.5}, regex="[ab]+")
    p = sampling_from_vllm(sp, 10, FACTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 5, 0.1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos, p.n) == (7, 2, ["x"], [3], True, 3)
    assert (p.logprobs, p.prompt_logprobs, p.include_stop_str_in_output) == (2, 0, True)
    assert p.seed == 2**63 - 1 and p.logit_bias == {4: 2.5} and p.structured == {"regex": "[ab]+"}
    assert sampling_from_vllm(vpb.SamplingParams(json_object=True), 1, FACTS).structured == {"json_object": True}
    choice = sampling_from_vllm(vpb.SamplingParams(choice=vpb.ChoiceConstraint(choices=["a", "b"])), 1, FACTS)
    assert choice.structured == {"choice": ["a", "b"]}


@pytest.mark.parametrize("sp, words", [
    (vpb.SamplingParams(logprobs=-1), "logprobs=-1"),
    (vpb.SamplingParams(prompt_logprobs=-1), "prompt_logprobs=-1"),
    (vpb.SamplingParams(top_p=1.5), "top_p"),
    (vpb.SamplingParams(n=100), "n="),
])
def test_bad_values_are_named(sp, words):
    with pytest.raises(ValueError, match=words):
        sampling_from_vllm(sp, 10, FACTS)


def test_a_prompt_without_room_is_refused():
    with pytest.raises(ValueError, match="no room for output"):
        sampling_from_vllm(vpb.SamplingParams(), 200, FACTS)


def test_truncate_prompt_tokens():
    ids = list(range(300))
    assert truncate_prompt(ids, vpb.SamplingParams(), FACTS) == ids
    assert truncate_prompt(ids, vpb.SamplingParams(truncate_prompt_tokens=3), FACTS) == [297, 298, 299]
    assert truncate_prompt(ids, vpb.SamplingParams(truncate_prompt_tokens=-1), FACTS) == ids[-256:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        truncate_prompt(ids, vpb.SamplingParams(truncate_prompt_tokens=-2), FACTS)


def test_events_become_the_protos_kv_events():
    batch = KvEventBatch(7, 1.5, [BlockStored([1, -5], 9, list(range(32)), 16), BlockRemoved([-5]),
                                  AllBlocksCleared()])
    proto = batch_to_proto(batch)
    assert proto.sequence_number == 7 and proto.timestamp == 1.5 and proto.dp_rank == 0
    stored, removed, cleared = proto.events
    assert [b.block_hash for b in stored.stored.blocks] == [1, -5] and stored.stored.parent_block_hash == 9
    assert [list(b.token_ids) for b in stored.stored.blocks] == [list(range(16)), list(range(16, 32))]
    assert removed.removed.block_hashes == [-5] and cleared.HasField("cleared")


def test_relay_stamps_batches_and_sends_heartbeats(monkeypatch):
    monkeypatch.setattr("nanoplane.controlplane.vllm_kv_events.HEARTBEAT_S", 0.05)

    async def source():
        yield KvEventBatch(1, time.time(), [AllBlocksCleared()])
        await asyncio.sleep(0.2)
        yield KvEventBatch(2, time.time(), [BlockRemoved([3])])

    async def run(before_first: bool) -> list[common_pb2.KvEventBatch]:
        got = []
        async for message in relay(source(), lambda: common_pb2.EngineLoad(running_requests=2), before_first):
            got.append(message)
        return got

    got = asyncio.run(run(False))
    assert [m.sequence_number for m in got if not m.load.load_only] == [1, 2]
    heartbeats = [m for m in got if m.load.load_only]
    assert heartbeats and all(m.sequence_number == 1 and not m.events for m in heartbeats)
    assert all(m.load.running_requests == 2 for m in got)
    samples = [m.load.sample for m in got]
    assert samples == sorted(samples) and len(set(samples)) == len(samples)
