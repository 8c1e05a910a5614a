"""vllm.grpc.engine.VllmEngine (PyPI smg-grpc-proto) over the same EngineFront as nanoplane.v1, on the
same port: what the Shepherd Model Gateway (SMG) and llm-d speak to a vLLM engine.

Fields are filled as vLLM's own servicer (smg_grpc_servicer.vllm) fills them. What this engine cannot
do (embeddings, multimodal input, KV transfer, profiling) answers UNIMPLEMENTED naming it.
Request conversion: vllm_requests.py; samples, stop strings and text: grpc_sampling.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from nanoplane.controlplane import tokenizer_archive
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.errors import DataPlaneUnavailable
from nanoplane.controlplane.front import EngineFront, EngineStats
from nanoplane.controlplane.grpc_sampling import SampleStreams
from nanoplane.controlplane.grpc_server import MAX_REQUEST_ID_CHARS, AddService, GenerationServicer
from nanoplane.controlplane.kv_events import KvEventsOff
from nanoplane.controlplane.metrics import NO_REQUEST_METRICS
from nanoplane.controlplane.tracing import NO_TRACE
from nanoplane.controlplane.vllm_kv_events import relay
from nanoplane.controlplane.vllm_requests import (
    VllmResponses,
    refuse_unsupported,
    sampling_from_vllm,
    truncate_prompt,
)

log = logging.getLogger(__name__)

SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "vllm-grpc"  # what vLLM's servicer reports; SMG picks its vLLM code paths by it
FLUSH_RETRY_S = 0.05  # FlushCache with a timeout: how often to try again while the data plane is down
try:
    VERSION = importlib.metadata.version("nanoplane")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+checkout"


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    """What GetModelInfo / GetServerInfo report beyond the engine's facts."""

    model_dir: Path
    name: str  # served model name
    max_num_seqs: int
    dtype: str  # the engine's option ("auto", "bfloat16", ...)
    device: str  # "cuda" or "cpu": what "auto" resolves by

    @property
    def hf_config(self) -> dict:
        path = self.model_dir / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, front: EngineFront, nano: GenerationServicer, model: ServedModel):
        """`nano`: the nanoplane.v1 servicer of the same server, whose prompt checks and tokenizer this shares."""
        self.front, self.nano, self.model = front, nano, model
        self.tokenizer = nano.tokenizer
        self.archive = tokenizer_archive.TokenizerArchive(model.model_dir)
        hf = model.hf_config
        self._hf = {k: hf.get(k) for k in ("model_type", "architectures", "pad_token_id", "bos_token_id",
                                             "torch_dtype")}
        self._started = time.monotonic()
        self._last_receive = 0.0
        self._queries = self._hits = 0  # prefix-cache tokens looked up / found, since start
        front.add_stats_listener(self._count_stats)

    def _count_stats(self, stats: EngineStats) -> None:
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits

    async def _prompt(self, request: vpb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("the request has no input: set tokenized.input_ids or text")
        if kind == "tokenized":
            if not request.tokenized.input_ids:
                raise ValueError("tokenized.input_ids is empty: give at least one token")
            return list(request.tokenized.input_ids)
        if not request.text:
            raise ValueError("the prompt text is empty")
        self.nano._check_text_length(len(request.text))
        return await asyncio.to_thread(self.nano._encode_text, request.text)

    async def Generate(self, request: vpb.GenerateRequest, context) -> AsyncIterator[vpb.GenerateResponse]:
        self._last_receive = time.time()
        measure = self.nano.metrics.request() if self.nano.metrics is not None else NO_REQUEST_METRICS
        trace = self.nano.tracing.request(context) if self.nano.tracing is not None else NO_TRACE
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id is {len(request.request_id)} characters long; at most "
                             f"{MAX_REQUEST_ID_CHARS} are allowed")
        refuse_unsupported(request)
        facts = self.front.facts
        token_ids = truncate_prompt(await self._prompt(request), request.sampling_params, facts)
        params = sampling_from_vllm(request.sampling_params, len(token_ids), facts)
        request_id = request.request_id or uuid.uuid4().hex
        samples = SampleStreams(request_id, self.tokenizer, token_ids, params)
        responses = VllmResponses(token_ids, params, request.stream)
        # aclosing: leaving for any reason (client gone, error) aborts the request at once (SampleStreams.run).
        async with aclosing(samples.run(self.front, token_ids, context.time_remaining(), measure, trace)) as outputs:
            async for out, response in outputs:
                for message in responses.messages(out, response):
                    yield message
        for message in responses.finals():
            yield message

    async def Embed(self, request: vpb.EmbedRequest, context) -> vpb.EmbedResponse:
        raise NotImplementedError("Embed: embeddings are not supported by this engine (a generative model only)")

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context) -> common_pb2.ProfileResponse:
        raise NotImplementedError("StartProfile: profiling is not supported by this engine")

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context) -> common_pb2.ProfileResponse:
        raise NotImplementedError("StopProfile: profiling is not supported by this engine")

    async def HealthCheck(self, request: vpb.HealthCheckRequest, context) -> vpb.HealthCheckResponse:
        ready = self.front.data_plane_ready
        return vpb.HealthCheckResponse(healthy=ready, message="Health" if ready else
                                       "the data plane is not available; retry later")

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        for request_id in request.request_ids:  # unknown ids (finished already) are ignored, as vLLM does
            self.front.abort(request_id)
        return vpb.AbortResponse()

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        """Drop every cached-but-free prefix block (those running requests hold stay cached); while the data
        plane is down, try again for up to timeout_s."""
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s}: must be a finite number >= 0")
        deadline = time.monotonic() + timeout_s
        while not await self.front.flush_prefix_cache():
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message="the data plane is not available; the prefix cache was not flushed")
            await asyncio.sleep(FLUSH_RETRY_S)
        return common_pb2.FlushCacheResponse(success=True, message="Local KV prefix cache flushed successfully")

    def _facts(self):
        facts = self.front.facts
        if facts is None:  # the facts come from the data plane's handshake
            raise DataPlaneUnavailable("no data plane has attached yet; retry later")
        return facts

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest, context) -> vpb.GetModelInfoResponse:
        facts = self._facts()
        hf = self._hf
        return vpb.GetModelInfoResponse(
            model_path=str(self.model.model_dir), is_generation=True, max_context_length=facts.max_model_len,
            vocab_size=facts.vocab_size, supports_vision=False, served_model_name=self.model.name,
            tokenizer_path=str(self.model.model_dir), model_type=hf["model_type"] or "",
            architectures=hf["architectures"] or [facts.architecture],
            eos_token_ids=list(self.tokenizer.eos_token_ids), pad_token_id=_int(hf["pad_token_id"]),
            bos_token_id=_int(hf["bos_token_id"]), max_req_input_len=facts.max_model_len,
            default_sampling_params_json="")  # nanoplane applies no generation_config defaults

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest, context) -> vpb.GetServerInfoResponse:
        status = self.front.status()
        facts = self.front.facts
        return vpb.GetServerInfoResponse(
            active_requests=status.running + status.waiting, is_paused=False,
            last_receive_timestamp=self._last_receive, uptime_seconds=time.monotonic() - self._started,
            server_type=SERVER_TYPE, data_parallel_size=1, kv_cache_dtype="auto",
            block_size=facts.block_size if facts is not None else 0, model_dtype=self._dtype(),
            max_num_seqs=self.model.max_num_seqs)

    def _dtype(self) -> str:
        """The weights' dtype as vLLM names it ("torch.bfloat16"); "auto" resolved as the data plane does."""
        dtype = self.model.dtype
        if dtype == "auto":
            dtype = "float32" if self.model.device == "cpu" else \
                "float16" if str(self._hf["torch_dtype"]).removeprefix("torch.") == "float16" else "bfloat16"
        return f"torch.{dtype}"

    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise ValueError(f"dp_rank={request.dp_rank}: this engine has one data-parallel rank, 0")
        return vpb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version=VERSION,
                                    dp_rank_count=1, loads=[self._scheduler_load()])

    def _scheduler_load(self) -> vpb.SchedulerLoad:
        s = self.front.status()
        facts = self.front.facts
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=s.running, num_waiting_reqs=s.waiting, num_total_reqs=s.running + s.waiting,
            token_usage=usage, utilization=usage, max_running_requests=self.model.max_num_seqs,
            cache_hit_rate=self._hits / self._queries if self._queries else 0.0)
        if facts is not None:
            load.num_used_tokens = s.kv_blocks_used * facts.block_size
            load.max_total_num_tokens = facts.kv_capacity_tokens
        return load

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data, sha256 = await self.archive.get()
        pieces = list(tokenizer_archive.chunks(data))
        for i, piece in enumerate(pieces):  # the digest rides on the last chunk only
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=sha256 if i == len(pieces) - 1 else "")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context) -> AsyncIterator[common_pb2.KvEventBatch]:
        try:
            batches = self.front.kv_events(request.start_sequence_number)
        except KvEventsOff as exc:  # vLLM's servicer answers UNIMPLEMENTED when its events are off
            raise NotImplementedError(str(exc)) from None
        await context.send_initial_metadata(())  # SMG counts a subscription unanswered for 2 s as a dead worker
        messages = relay(batches, self._load_record, request.load_records_before_first_batch)
        async with contextlib.aclosing(batches), contextlib.aclosing(messages):
            async for message in messages:
                yield message

    def _load_record(self) -> common_pb2.EngineLoad:
        """GetLoads' figures as the record a KV-event batch carries."""
        load = self._scheduler_load()
        return common_pb2.EngineLoad(
            running_requests=load.num_running_reqs, waiting_requests=load.num_waiting_reqs,
            token_usage=load.token_usage, active_token_usage=load.token_usage,
            max_running_requests=load.max_running_requests, cache_hit_rate=load.cache_hit_rate,
            num_used_tokens=load.num_used_tokens, max_total_num_tokens=load.max_total_num_tokens)


def _int(value: object) -> int:
    """A config's token id: an int, or a list's first; 0 when absent, as vLLM's config view reads it."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else 0


def vllm_service(config: EngineConfig, name: str) -> AddService:
    """GenerationServer's hook that serves VllmEngine beside nanoplane.v1 (`services=[...]`)."""
    model = ServedModel(Path(config.model), name, config.max_num_seqs, config.dtype, config.device)

    def add(server: grpc.aio.Server, nano: GenerationServicer) -> str:
        servicer = VllmEngineServicer(nano.front, nano, model)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
        return SERVICE
    return add
