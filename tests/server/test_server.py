"""The gRPC service against a real server on 127.0.0.1 (ephemeral ports): streamed output equals the
engine's, status codes, cancellation and deadlines free the KV pool, Abort from another connection,
health, reflection without generated stubs, metrics that move by exact amounts, drain."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from asyncspec import SamplingParams
from asyncspec.server.app import ServerConfig
from asyncspec.server.service import SERVICE_NAME
from asyncspec.v1 import asyncspec_pb2 as pb
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc
from tests.conftest import load_prompts
from tests.engine.engine_helpers import bundled_llm, bundled_target_with_generation_config
from tests.server.server_helpers import ENGINE, ServerThread

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(one_thread):
    s = ServerThread()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompts():
    return [p[:40] for p in load_prompts(6)]


def _request(prompt, max_tokens=12, **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    request.sampling.temperature = sampling.pop("temperature", 0.0)
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


def _wait_kv_free(server: ServerThread, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running_requests"] == 0:
            return stats
        assert time.monotonic() < deadline, f"KV blocks not freed: {stats}"
        time.sleep(0.02)


def _wait_not_ready(server: ServerThread, timeout: float) -> None:
    """Until the readiness check stops saying SERVING."""
    health = health_pb2_grpc.HealthStub(server.channel())
    deadline = time.monotonic() + timeout
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    while health.Check(request).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "readiness still SERVING"
        time.sleep(0.01)


def _metrics(server: ServerThread) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def test_streamed_output_equals_the_engine_and_usage_is_exact(server, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = bundled_llm(**ENGINE).generate(prompts, params)
    stub = server.stub()
    for prompt, ref in zip(prompts, reference, strict=True):
        responses = list(stub.Generate(_request(prompt)))
        assert [t for r in responses for t in r.token_ids] == ref.token_ids
        assert "".join(r.text for r in responses) == ref.text
        last = responses[-1]
        assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
        assert all(not r.finished for r in responses[:-1]) and len({r.request_id for r in responses}) == 1
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 12
    _wait_kv_free(server)


def _concurrent_streams(server: ServerThread, prompts, n: int) -> dict[int, list[int]]:
    """n client threads, stream i on prompt i mod len(prompts): the token ids each received."""
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        stub = server.stub()
        results[i] = [t for r in stub.Generate(_request(prompts[i % len(prompts)])) for t in r.token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_many_concurrent_streams_complete(server, prompts):
    reference = bundled_llm(**ENGINE).generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    results = _concurrent_streams(server, prompts, 64)
    assert len(results) == 64
    for i, tokens in results.items():
        assert tokens == reference[i % len(prompts)].token_ids
    _wait_kv_free(server)


def test_tokenize_adds_the_special_tokens_generate_adds(server):
    """With a Llama-style post-processor (BOS first), Tokenize's default ids are the prompt Generate runs for the
    same text; add_special_tokens=false gives the bare text's ids."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = server.server.engine.engine.tokenizer
    before = tokenizer.post_processor
    bos = tokenizer.id_to_token(0)
    tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    try:
        stub = server.stub()
        with_bos = list(stub.Tokenize(pb.TokenizeRequest(text="def main():\n")).token_ids)
        bare = list(stub.Tokenize(pb.TokenizeRequest(text="def main():\n", add_special_tokens=False)).token_ids)
        assert with_bos == [0, *bare]
        by_text = [t for r in stub.Generate(_request("def main():\n", 6)) for t in r.token_ids]
        assert by_text == [t for r in stub.Generate(_request(with_bos, 6)) for t in r.token_ids]
        assert by_text != [t for r in stub.Generate(_request(bare, 6)) for t in r.token_ids]
    finally:
        tokenizer.post_processor = before
    _wait_kv_free(server)


def test_text_prompt_tokenize_detokenize_and_model_info(server):
    stub = server.stub()
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="def main():\n")).token_ids)
    assert ids and stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "def main():\n"
    by_text = [t for r in stub.Generate(_request("def main():\n", 6)) for t in r.token_ids]
    by_ids = [t for r in stub.Generate(_request(ids, 6)) for t in r.token_ids]
    assert by_text == by_ids and len(by_text) == 6
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.vocab_size == 8192 and info.max_model_len == 256 and info.model.endswith("stdlib-coder-target")
    assert info.tensor_parallel_size == 1
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[5, 9000]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in e.value.details()


def test_client_cancel_and_deadline_abort_the_request(server, prompts):
    stub = server.stub()
    call = stub.Generate(_request(prompts[0], 200))
    next(call)
    call.cancel()
    _wait_kv_free(server)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(prompts[1], 200), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_kv_free(server)


def test_unset_max_tokens_generates_up_to_max_model_len(server, prompts):
    """The proto's default: up to max_model_len (SamplingParams' own default of 16 must not leak through), so a
    min_tokens alone above 16 is valid too."""
    request = _request(prompts[0])
    request.stopping.ClearField("max_tokens")
    request.stopping.min_tokens = 100
    responses = list(server.stub().Generate(request))
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 256 - len(prompts[0]) == sum(len(r.token_ids) for r in responses)
    _wait_kv_free(server)


def test_cancelled_and_timed_out_streams_count_as_aborted_requests(server, prompts):
    """vLLM counts a client's disconnect as a finished request with reason abort: so do request_success_total
    and the end-to-end latency histogram, once each, for a cancel and a deadline."""
    _wait_kv_free(server)
    before = _metrics(server)
    stub = server.stub()
    call = stub.Generate(_request(prompts[0], 200))
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(prompts[1], 200), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_kv_free(server)
    key = "asyncspec:request_success_total{finished_reason=abort}"
    deadline = time.monotonic() + 10
    while _metrics(server).get(key, 0.0) - before.get(key, 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _metrics(server)
    assert after.get(key, 0.0) - before.get(key, 0.0) == 2
    count = "asyncspec:e2e_request_latency_seconds_count"
    assert after[count] - before.get(count, 0.0) == 2


def test_abort_from_another_connection(server, prompts):
    request = _request(prompts[2], 200)
    request.request_id = "to-abort"
    call = server.stub().Generate(request)
    first = next(call)
    assert first.request_id == "to-abort"
    assert server.stub().Abort(pb.AbortRequest(request_id="to-abort")).found
    last = list(call)[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORTED
    assert not server.stub().Abort(pb.AbortRequest(request_id="to-abort")).found
    _wait_kv_free(server)


def _bad_requests(prompt: list[int]) -> list[tuple[str, pb.GenerateRequest]]:
    def with_(field_path: str, value, base=None):
        request = base if base is not None else _request(prompt)
        target = request
        *parents, name = field_path.split(".")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
        return request

    neither = pb.GenerateRequest()
    empty_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))
    return [
        ("prompt", neither),
        ("empty", empty_ids),
        ("empty", pb.GenerateRequest(text="")),
        ("prompt token 1", _request([5, 9000])),
        ("prompt token 0", _request([-3, 5])),
        ("max_model_len", _request([5] * 300)),
        ("priority", with_("priority", 3)),  # the test server schedules fcfs
        ("temperature", with_("sampling.temperature", float("nan"))),
        ("temperature", with_("sampling.temperature", float("inf"))),
        ("temperature", with_("sampling.temperature", -1.0)),
        ("top_p", with_("sampling.top_p", 0.0)),
        ("top_p", with_("sampling.top_p", 1.5)),
        ("top_k", with_("sampling.top_k", -2)),
        ("min_p", with_("sampling.min_p", -0.1)),
        ("min_p", with_("sampling.min_p", 1.5)),
        ("repetition_penalty", with_("sampling.repetition_penalty", 0.0)),
        ("presence_penalty", with_("sampling.presence_penalty", 5.0)),
        ("frequency_penalty", with_("sampling.frequency_penalty", float("nan"))),
        ("max_tokens", with_("stopping.max_tokens", 0)),
        ("max_tokens", with_("stopping.max_tokens", -4)),
        ("min_tokens", with_("stopping.min_tokens", -1)),
        ("stop", with_("stopping.stop", ["x"] * 5000)),
        ("stop", with_("stopping.stop", [""])),
        ("stop_token_ids", with_("stopping.stop_token_ids", [99999])),
        # Long lists: the message names the bad entry, and stays short enough for a gRPC status.
        (
            "stop_token_ids[8192] must be a token id in [0, 8192), got 99999",
            with_("stopping.stop_token_ids", [*range(8192), 99999]),
        ),
        ("stop[4000] must be a non-empty string", with_("stopping.stop", ["x"] * 4000 + [""])),
        ("logprobs", with_("output.logprobs", 50)),
        ("logprobs", with_("output.logprobs", -1)),
    ]


def _refused(server: ServerThread, reason: str) -> float:
    value = server.server.metrics.registry.get_sample_value("asyncspec:request_refused_total", {"reason": reason})
    assert value is not None
    return value


@pytest.mark.parametrize("engine_process", [False, True])
def test_unset_fields_take_the_models_generation_config(tmp_path, prompts, engine_process: bool):
    """As vLLM's server: a field the request leaves unset takes the model's generation_config.json value (here
    greedy, top_k 3 and 6 tokens), a field it sets wins, also with the engine in its own process."""
    model = bundled_target_with_generation_config(tmp_path / "m", {"temperature": 0.0, "top_k": 3, "max_new_tokens": 6})
    llm = bundled_llm(**ENGINE, model=model)
    greedy = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    sampled_params = SamplingParams(temperature=1.0, top_k=3, seed=7, max_tokens=20, ignore_eos=True)
    sampled = llm.generate(prompts[0], sampled_params)[0]
    server = ServerThread(model=model, engine_process=engine_process)
    try:
        stub = server.stub()
        unset = pb.GenerateRequest(stopping=pb.StoppingOptions(ignore_eos=True))
        unset.token_ids.ids.extend(prompts[0])
        assert [t for r in stub.Generate(unset) for t in r.token_ids] == greedy.token_ids
        request = _request(prompts[0], max_tokens=20, temperature=1.0, seed=7)
        assert [t for r in stub.Generate(request) for t in r.token_ids] == sampled.token_ids
    finally:
        server.stop()


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_slow_reader_gets_its_piled_up_tokens_in_messages_under_the_limit(prompts, engine_process: bool):
    """Deltas that pile up while a client does not read are merged, but never into a message past the server's
    max_message_bytes, which gRPC would refuse to send (the stream ending RESOURCE_EXHAUSTED, its tokens lost)."""
    limit = 16384
    reference = bundled_llm(**ENGINE).generate(
        prompts[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=20)
    )[0]
    server = ServerThread(engine_process=engine_process, max_message_bytes=limit)
    try:
        request = _request(prompts[0], max_tokens=200)
        request.output.logprobs = 20
        # A small flow-control window, so that the server's sends wait for the reader and its deltas pile up.
        options = {"grpc.http2.lookahead_bytes": 1024, "grpc.http2.bdp_probe": 0}
        stub = pb_grpc.GenerationStub(server.channel(**options))
        call = stub.Generate(request, timeout=60)
        responses = [next(call)]
        deadline = time.monotonic() + 30
        while server.stats()["num_running_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the client reads nothing until the engine has finished the request
        responses += list(call)
        assert max(r.ByteSize() for r in responses) < limit
        assert [t for r in responses for t in r.token_ids] == reference.token_ids
        assert [list(lp.token_ids) for r in responses for lp in r.logprobs] == [
            lp.token_ids for lp in reference.logprobs
        ]
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.stop()


def test_bad_requests_are_invalid_argument_naming_the_field(server, prompts):
    stub = server.stub()
    bad = _bad_requests(prompts[0])
    assert len(bad) >= 25
    refused_before = _refused(server, "invalid_request")
    finished_before = sum(v for k, v in _metrics(server).items() if k.startswith("asyncspec:request_success_total"))
    for field, request in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
        assert field in e.value.details(), (field, e.value.details())
    # A duplicate id of a live request.
    live = _request(prompts[0], 200)
    live.request_id = "dup"
    call = stub.Generate(live)
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(live))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dup" in e.value.details()
    call.cancel()
    # Each refusal counted once, by reason, and none as a finished request (the cancelled live one is an abort).
    assert _refused(server, "invalid_request") - refused_before == len(bad) + 1
    _wait_kv_free(server)
    finished = sum(v for k, v in _metrics(server).items() if k.startswith("asyncspec:request_success_total"))
    assert finished - finished_before == 1
    # An oversized message is refused by the transport.
    small = grpc.insecure_channel(server.address)
    with pytest.raises(grpc.RpcError) as e:
        list(pb_stub(small).Generate(_request("x" * (17 * 2**20))))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server keeps serving correct answers.
    reference = bundled_llm(**ENGINE).generate(
        [prompts[3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert [t for r in stub.Generate(_request(prompts[3])) for t in r.token_ids] == reference[0].token_ids
    _wait_kv_free(server)


def _raw_call(channel, method: str, kind: str = "unary_stream"):
    """A call that sends bytes as they are: a message no generated stub would build."""
    return getattr(channel, kind)(method, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)


def _bad_utf8(message) -> bytes:
    """The message with its marker "XY" replaced by bytes that are not UTF-8."""
    raw = message.SerializeToString()
    assert raw.count(b"XY") == 1
    return raw.replace(b"XY", b"\xff\xfe")


def test_a_refusal_quoting_a_long_non_ascii_id_stays_invalid_argument(server, prompts):
    """gRPC percent-encodes a status message (a euro sign takes nine bytes): a refusal that quotes a long id is cut
    to what the client's metadata limit holds, or the client would read RESOURCE_EXHAUSTED ("retry later")."""
    stub = server.stub()
    live = _request(prompts[0], 200)
    live.request_id = "€" * 3000
    call = stub.Generate(live)
    next(call)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(live))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()[:200]
        assert "already in use" in e.value.details() or e.value.details().endswith("characters)")
    finally:
        call.cancel()
    _wait_kv_free(server)


def test_unparsable_messages_are_invalid_argument(server, prompts):
    """A string field with invalid UTF-8 fails in protobuf's parser, before any servicer runs; grpc alone answers
    UNKNOWN. Every unary-request method says INVALID_ARGUMENT with protobuf's reason, and the server keeps serving."""
    channel = server.channel()
    cases = [
        ("/asyncspec.v1.Generation/Generate", "unary_stream", _bad_utf8(_request("abXY", 3)), "GenerateRequest"),
        (
            "/asyncspec.v1.Generation/Tokenize",
            "unary_unary",
            _bad_utf8(pb.TokenizeRequest(text="XY")),
            "TokenizeRequest",
        ),
        ("/asyncspec.v1.Generation/Abort", "unary_unary", _bad_utf8(pb.AbortRequest(request_id="XY")), "AbortRequest"),
        ("/asyncspec.v1.Generation/GetModelInfo", "unary_unary", b"\xff\xff\xff", "GetModelInfoRequest"),
        (
            "/grpc.health.v1.Health/Check",
            "unary_unary",
            _bad_utf8(health_pb2.HealthCheckRequest(service="XY")),
            "Health",
        ),
        (
            "/grpc.health.v1.Health/Watch",
            "unary_stream",
            _bad_utf8(health_pb2.HealthCheckRequest(service="XY")),
            "Health",
        ),
    ]
    for method, kind, raw, message_name in cases:
        with pytest.raises(grpc.RpcError) as e:
            result = _raw_call(channel, method, kind)(raw, timeout=20)
            if kind == "unary_stream":
                list(result)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.code(), e.value.details())
        assert "malformed request" in e.value.details() and message_name in e.value.details(), e.value.details()
    # Well-formed calls through the same wrapped handlers still work, streaming ones included.
    stub = server.stub()
    assert stub.Tokenize(pb.TokenizeRequest(text="hello")).token_ids
    assert list(stub.Generate(_request(prompts[0], 3)))[-1].usage.completion_tokens == 3
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=20)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    _wait_kv_free(server)


def pb_stub(channel):
    from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc

    return pb_grpc.GenerationStub(channel)


def test_health_and_reflection_only_client(server, prompts):
    health = health_pb2_grpc.HealthStub(server.channel())
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    # A client with no generated stubs: the service's descriptors come from server reflection.
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = server.channel()
    database = ProtoReflectionDescriptorDatabase(channel)
    assert SERVICE_NAME in list(database.get_services())
    pool = descriptor_pool.DescriptorPool(database)
    method = pool.FindServiceByName(SERVICE_NAME).FindMethodByName("Generate")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    request = request_cls()
    request.token_ids.ids.extend(prompts[0])
    request.stopping.max_tokens = 5
    request.stopping.ignore_eos = True
    request.sampling.temperature = 0.0
    call = channel.unary_stream(
        f"/{SERVICE_NAME}/Generate",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    responses = list(call(request))
    expected = [t for r in server.stub().Generate(_request(prompts[0], 5)) for t in r.token_ids]
    assert [t for r in responses for t in r.token_ids] == expected and responses[-1].finished


def test_metrics_move_by_exact_amounts(server, prompts):
    _wait_kv_free(server)
    before = _metrics(server)
    stub = server.stub()
    for prompt in prompts[:3]:
        list(stub.Generate(_request(prompt, 7)))
    request = _request(prompts[3], 200)
    request.request_id = "metrics-abort"
    call = stub.Generate(request)
    next(call)
    stub.Abort(pb.AbortRequest(request_id="metrics-abort"))
    list(call)
    _wait_kv_free(server)
    after = _metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("asyncspec:request_success_total{finished_reason=length}") == 3
    assert delta("asyncspec:request_success_total{finished_reason=abort}") == 1
    assert delta("asyncspec:time_to_first_token_seconds_count") == 4
    assert delta("asyncspec:e2e_request_latency_seconds_count") == 4
    assert delta("asyncspec:request_queue_time_seconds_count") == 4
    # Every step retired is one observation of its token count, and the counts add up.
    assert delta("asyncspec:iteration_tokens_total_count") == delta("asyncspec:num_steps_total") > 0
    # (each request's first token comes from its last prefill step, every later one from a decode)
    assert delta("asyncspec:iteration_tokens_total_sum") == (
        delta("asyncspec:prompt_tokens_computed_total") + delta("asyncspec:generation_tokens_total") - 4
    )
    # Prompt tokens are computed unless the prefix cache held them (these prompts ran before).
    computed, cached = delta("asyncspec:prompt_tokens_computed_total"), delta("asyncspec:prefix_cache_hits_total")
    assert computed + cached == sum(len(p) for p in prompts[:4])
    # vLLM's prompt_tokens: each request's prompt once (all four produced a token), split by source.
    assert delta("asyncspec:prompt_tokens_total") == sum(len(p) for p in prompts[:4])
    assert delta("asyncspec:prompt_tokens_by_source_total{source=local_cache_hit}") == cached
    assert delta("asyncspec:prompt_tokens_by_source_total{source=local_compute}") == computed
    assert delta("asyncspec:prefix_cache_queries_total") == sum(len(p) for p in prompts[:4])
    generated = delta("asyncspec:generation_tokens_total")
    assert generated >= 3 * 7 + 1
    # Every token but each request's first closes an inter-token gap.
    assert delta("asyncspec:inter_token_latency_seconds_count") == generated - 4
    assert after["asyncspec:num_requests_running"] == 0 and after["asyncspec:kv_cache_usage_perc"] == 0.0
    for key in (
        "asyncspec:step_scheduling_seconds_total",
        "asyncspec:gpu_idle_seconds_total",
        "asyncspec:num_admission_deferrals_total",
    ):
        assert key in after
    # One step a plan on the CPU: no run to defer an admission for.
    assert delta("asyncspec:num_admission_deferrals_total") == 0


def test_drain_refuses_new_requests_and_turns_readiness_off(prompts):
    server = ServerThread()
    try:
        stub = server.stub()
        call = stub.Generate(_request(prompts[0], 40))
        next(call)
        drained = threading.Thread(target=server.stop, kwargs={"grace_s": 30.0})
        drained.start()
        _wait_not_ready(server, 10.0)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(prompts[1], 4)))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _refused(server, "unavailable") == 1
        # The stream in flight finishes within the grace period.
        rest = list(call)
        assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        drained.join(30)
        assert not drained.is_alive()
    finally:
        server.stop()


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_streams_left_at_the_end_of_a_drain_end_aborted_with_their_usage(prompts, engine_process: bool):
    """The API's finish reason for a shutdown: a stream still running when the grace period ends gets a final
    ABORTED response with its usage, not an UNAVAILABLE status after partial output (a client retrying that
    would generate the streamed text again)."""
    server = ServerThread(engine_process=engine_process)
    try:
        call = server.stub().Generate(_request(prompts[0], 200))
        first = next(call)
        server.stop(grace_s=0.3)
        responses = [first, *call]
        last = responses[-1]
        assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORTED
        received = sum(len(r.token_ids) for r in responses)
        assert 0 < received < 200 and last.usage.completion_tokens == received
        assert last.usage.prompt_tokens == len(prompts[0])
    finally:
        server.stop()


def test_a_second_server_on_a_port_in_use_is_refused(server):
    """grpc sets SO_REUSEPORT by default: a second server would bind the same port and take half its calls."""
    import asyncio

    from asyncspec.server.app import GenerationServer, ServerStartError

    config = ServerConfig(host="127.0.0.1", port=server.server.port, metrics_port=0, engine_process=False)
    second = GenerationServer(server.engine_config, config)
    with pytest.raises(ServerStartError, match=str(server.server.port)):
        asyncio.run(second.start())


@pytest.mark.parametrize("env_token", ["s3cret", "s3cret\n"], ids=["plain", "trailing-newline"])
def test_bearer_token_from_the_environment(monkeypatch, prompts, env_token):
    """A Secret made from a file usually ends in a newline, which no client can send: stripped, as the file is."""
    monkeypatch.setenv("ASYNCSPEC_AUTH_TOKEN", env_token)
    server = ServerThread()
    try:
        ok = list(server.stub().Generate(_request(prompts[0], 2), metadata=[("authorization", "Bearer s3cret")]))
        assert ok[-1].finished and ok[-1].usage.completion_tokens == 2
    finally:
        server.stop()


@pytest.mark.parametrize("token", ["sécret", "two\tparts"])
def test_a_bearer_token_no_client_could_send_is_refused_at_start(monkeypatch, tmp_path, token):
    """gRPC metadata is printable ASCII: such a token would lock every client out (and made each call UNKNOWN)."""
    from asyncspec.server.app import ServerStartError

    monkeypatch.setenv("ASYNCSPEC_AUTH_TOKEN", token)
    with pytest.raises(ServerStartError, match=r"\$ASYNCSPEC_AUTH_TOKEN must be printable ASCII"):
        ServerConfig().auth_token()
    (tmp_path / "token").write_text(token, encoding="utf-8")
    with pytest.raises(ServerStartError, match="auth_token_file .*token.* must be printable ASCII"):
        ServerConfig(auth_token_file=str(tmp_path / "token")).auth_token()


def test_a_non_ascii_authorization_header_is_unauthenticated():
    """compare_digest raises TypeError on a str with non-ASCII characters: the header is compared as bytes."""
    import asyncio
    from types import SimpleNamespace

    from asyncspec.server.app import BearerTokenInterceptor

    interceptor = BearerTokenInterceptor("s3cret")
    granted = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))

    async def continuation(details):
        return granted

    def check(header: str):
        details = SimpleNamespace(
            method="/asyncspec.v1.Generation/Generate", invocation_metadata=[("authorization", header)]
        )
        return asyncio.run(interceptor.intercept_service(continuation, details))

    assert check("Bearer s3cret") is granted
    assert check("Bearer sécret") is not granted


def test_bearer_token(monkeypatch, prompts):
    monkeypatch.setenv("ASYNCSPEC_AUTH_TOKEN", "s3cret")
    server = ServerThread()
    try:
        stub = server.stub()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(prompts[0], 3)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # An unparsable message without the token learns only that the token is missing.
        generate = _raw_call(server.channel(), "/asyncspec.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(generate(_bad_utf8(_request("abXY", 3))))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(generate(_bad_utf8(_request("abXY", 3)), metadata=[("authorization", "Bearer s3cret")]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = list(stub.Generate(_request(prompts[0], 3), metadata=[("authorization", "Bearer s3cret")]))
        assert ok[-1].finished and ok[-1].usage.completion_tokens == 3
        health = health_pb2_grpc.HealthStub(server.channel())  # probes carry no token
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        # Reflection is no probe: without the token it answers nothing (README: every call but the health checks).
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel())
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as e:
            list(reflect.ServerReflectionInfo(iter([ask])))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = list(reflect.ServerReflectionInfo(iter([ask]), metadata=[("authorization", "Bearer s3cret")]))
        assert SERVICE_NAME in {s.name for s in answers[0].list_services_response.service}
    finally:
        server.stop()


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_full_queue_is_resource_exhausted_and_nothing_lost(prompts, engine_process: bool):
    server = ServerThread({"max_num_seqs": 1, "max_num_waiting": 1}, engine_process=engine_process)
    try:
        stub = server.stub()
        running = stub.Generate(_request(prompts[0], 60))
        next(running)
        waiting = stub.Generate(_request(prompts[1], 4))
        refused = 0
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            try:
                list(stub.Generate(_request(prompts[2], 4)))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                assert "max_num_waiting" in e.details()
                refused += 1
        assert refused
        assert _refused(server, "queue_full") == refused
        assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert list(waiting)[-1].usage.completion_tokens == 4
        _wait_kv_free(server)
    finally:
        server.stop()


@pytest.mark.parametrize("detail", ["", " (" + "rank state " * 3000 + ")"], ids=["short", "30k-characters"])
def test_engine_fault_ends_streams_with_internal_and_health_not_serving(prompts, detail):
    """A long error (a rank's repr, debug-mode token lists) is cut to fit a status message: INTERNAL still comes."""
    server = ServerThread()
    try:
        core = server.server.engine.engine.engine_core
        real_step = core.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected device fault" + detail)
            return real_step()

        core.step = failing_step
        stub = server.stub()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(prompts[0], 100), timeout=30))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected device fault" in e.value.details()
        assert len(e.value.details()) < 8192
        _wait_not_ready(server, 5.0)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(prompts[1], 4), timeout=10))
        assert e.value.code() == grpc.StatusCode.INTERNAL
    finally:
        server.stop()


@pytest.mark.parametrize("fail_after", [5, 0], ids=["after-5-tokens", "before-its-first-token"])
def test_a_request_that_fails_alone_reports_its_whole_usage(prompts, monkeypatch, fail_after):
    """FINISH_REASON_ERROR's usage carries what the request's outputs counted, its prefix-cache hit included, also
    when it failed before a first delta."""
    from asyncspec.engine import detokenizer

    real_update = detokenizer.IncrementalDetokenizer.update

    def failing_update(self, token_ids):
        if self.num_output_tokens >= fail_after:
            raise RuntimeError("injected detokenizer fault")
        return real_update(self, token_ids)

    server = ServerThread()
    try:
        stub = server.stub()
        text = "import os\nimport sys\nimport time\nimport json\nimport re\n" * 4  # full blocks to hit
        list(stub.Generate(_request(text, 4)))  # its blocks stay cached
        monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", failing_update)
        responses = list(stub.Generate(_request(text, 30)))
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_ERROR and "injected detokenizer fault" in last.error
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses) >= fail_after
        prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
        assert last.usage.prompt_tokens == len(prompt_ids) and 0 < last.usage.cached_tokens < len(prompt_ids)
    finally:
        monkeypatch.undo()
        server.stop()


def _liveness(server: ServerThread) -> int:
    health = health_pb2_grpc.HealthStub(server.channel())
    return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_a_hung_engine_ends_its_streams_and_turns_liveness_off(prompts):
    """A step that never returns (a stuck kernel) leaves the engine alive to every other check: with no step
    finishing for engine_stall_timeout_s while requests are unfinished, the streams end with INTERNAL and liveness
    goes NOT_SERVING (serve then exits 1), not a hang until each client's deadline."""
    server = ServerThread(engine_stall_timeout_s=3.0)  # well above a step on a loaded 2-core machine
    release = threading.Event()
    try:
        core = server.server.engine.engine.engine_core
        real_step = core.step
        calls = {"n": 0}

        def hanging_step():
            calls["n"] += 1
            if calls["n"] == 4:
                release.wait(120)
            return real_step()

        core.step = hanging_step
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(server.stub().Generate(_request(prompts[0], 100), timeout=60))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "hung" in e.value.details(), e.value.details()
        assert time.monotonic() - start < 20
        assert server.server.engine_failed.is_set()
        deadline = time.monotonic() + 5
        while _liveness(server) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        server.stop()


def test_a_frozen_engine_process_is_declared_hung(prompts):
    """The engine in its own process, stopped by SIGSTOP: alive, silent, and caught by the same watchdog."""
    server = ServerThread(engine_process=True, engine_stall_timeout_s=3.0)
    pid = server.server.engine._process.pid
    try:
        stub = server.stub()
        call = stub.Generate(_request(prompts[0], 200), timeout=60)
        next(call)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "hung" in e.value.details(), e.value.details()
        assert server.server.engine_failed.is_set()
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()


def test_the_stall_watchdog_ignores_an_idle_engine_and_a_slow_reader(prompts):
    """Neither an engine with nothing to do nor a client that stops reading after its request finished in the
    engine is a hang."""
    server = ServerThread(engine_stall_timeout_s=2.0)
    try:
        call = server.stub().Generate(_request(prompts[0], 12))
        next(call)
        _wait_kv_free(server)  # the request ended in the engine; its stream is not read yet
        time.sleep(5.0)
        rest = list(call)
        assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        time.sleep(3.0)
        assert _liveness(server) == health_pb2.HealthCheckResponse.SERVING
        assert not server.server.engine_failed.is_set()
    finally:
        server.stop()


def test_tls_client_with_the_test_ca(tmp_path, prompts, capsys):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,DNS:asyncspec.internal",
        ],
        check=True,
        capture_output=True,
    )
    server = ServerThread(tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        channel = grpc.secure_channel(f"localhost:{server.server.port}", credentials)
        responses = list(pb_stub(channel).Generate(_request(prompts[0], 3)))
        assert responses[-1].usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError):  # plaintext to a TLS port fails
            list(server.stub().Generate(_request(prompts[0], 3), timeout=5))
        _command_line_clients_speak_tls(server, cert, tmp_path, capsys)
    finally:
        server.stop()


def _command_line_clients_speak_tls(server: ServerThread, cert: Path, tmp_path: Path, capsys) -> None:
    """The image's HEALTHCHECK, `generate` and `bench` reach a TLS server: dialling 127.0.0.1 (which the certificate
    does not name) with the certificate's name given, or by a name it holds."""
    import json

    from asyncspec.cli import main

    port = server.server.port
    readiness = ["health", "--service", SERVICE_NAME, "--timeout", "10"]
    assert main([*readiness, "--address", f"127.0.0.1:{port}"]) == 1  # plaintext
    assert main([*readiness, "--address", f"127.0.0.1:{port}", "--tls-ca-file", str(cert)]) == 1  # name mismatch
    named = ["--tls-ca-file", str(cert), "--tls-server-name", "asyncspec.internal"]
    assert main([*readiness, "--address", f"127.0.0.1:{port}", *named]) == 0
    assert main([*readiness, "--address", f"localhost:{port}", "--tls-ca-file", str(cert)]) == 0
    assert main(["health", "--address", f"localhost:{port}", "--tls", "--timeout", "10"]) == 1  # not a public CA
    capsys.readouterr()
    args = ["--address", f"127.0.0.1:{port}", *named, "--max-tokens", "3"]
    assert main(["generate", *args, "def f("]) == 0
    assert "3 tokens" in capsys.readouterr().err
    dataset, out = tmp_path / "prompts.jsonl", tmp_path / "bench.json"
    dataset.write_text("".join(json.dumps({"prompt_token_ids": p[:16]}) + "\n" for p in load_prompts(2)))
    bench = ["bench", *args, "--num-prompts", "2", "--dataset", str(dataset), "--output", str(out)]
    assert main(bench) == 0 and json.loads(out.read_text())["completed"] == 2
    # Flags that cannot work say so.
    assert main(["health", "--address", f"127.0.0.1:{port}", "--tls-server-name", "asyncspec.internal"]) == 1
    assert "--tls-server-name needs --tls" in capsys.readouterr().err
    assert main([*readiness, "--address", f"127.0.0.1:{port}", "--tls-ca-file", str(tmp_path / "none.pem")]) == 1
    assert "cannot read --tls-ca-file" in capsys.readouterr().err


def test_bench_against_the_test_server_fills_every_field(server, tmp_path):
    import json

    from asyncspec.cli import main

    out, dataset = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt_token_ids": p[:48]}) + "\n" for p in load_prompts(5)))
    args = ["bench", "--address", server.address, "--num-prompts", "12", "--max-tokens", "6", "--concurrency", "4"]
    args += ["--dataset", str(dataset)]
    assert main([*args, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0 and report["total_output_tokens"] == 72
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert report[f"{stat}_{key}_ms"] >= 0
        assert report[f"mean_{key}_ms"] > 0
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    # Poisson arrivals.
    assert main([*args, "--request-rate", "50", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["request_rate"] == 50
    _wait_kv_free(server)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_speculative_usage_metrics_and_bench_acceptance_length(prompts, tmp_path, engine_process: bool):
    """With the draft model on: a stream's usage carries its drafts, draft tokens and accepted tokens,
    exactly what the engine and the Prometheus counters count for it (the engine in the server's process
    or in its own); the bench reports the mean acceptance length 1 + accepted / drafts."""
    import json

    from asyncspec.cli import main

    server = ServerThread(
        {"speculative_method": "draft_model", "num_speculative_tokens": 4, "max_num_batched_tokens": 320},
        engine_process=engine_process,
    )
    try:
        before, metrics_before = server.stats(), _metrics(server)
        responses = list(server.stub().Generate(_request(prompts[0][:64], 40), timeout=60))
        usage = responses[-1].usage
        after, metrics_after = _wait_kv_free(server), _metrics(server)
        assert usage.completion_tokens == 40 and 0 < usage.num_drafts <= usage.drafted_tokens
        assert 0 < usage.accepted_tokens <= usage.drafted_tokens
        assert usage.num_drafts == after["spec_num_drafts"] - before["spec_num_drafts"]
        assert usage.drafted_tokens == after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        assert usage.accepted_tokens == after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        for name, value in (
            ("num_drafts", usage.num_drafts),
            ("num_draft_tokens", usage.drafted_tokens),
            ("num_accepted_tokens", usage.accepted_tokens),
        ):
            key = f"asyncspec:spec_decode_{name}_total"
            assert metrics_after[key] - metrics_before[key] == value, key

        out, dataset = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt_token_ids": p[:48]}) + "\n" for p in load_prompts(4)))
        args = ["bench", "--address", server.address, "--num-prompts", "8", "--max-tokens", "24"]
        assert main([*args, "--concurrency", "4", "--dataset", str(dataset), "--output", str(out)]) == 0
        report = json.loads(out.read_text())
        drafts, accepted = report["spec_decode_num_drafts"], report["spec_decode_num_accepted_tokens"]
        assert drafts > 0 and report["spec_decode_acceptance_length"] == 1 + accepted / drafts > 1
        assert report["spec_decode_acceptance_rate"] == accepted / report["spec_decode_num_draft_tokens"]
    finally:
        server.stop()


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of `pid` (the tensor-parallel ranks, not the resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def _tensor_parallel_ranks(serve_pid: int) -> list[int]:
    """The ranks of a `serve` with its defaults: children of its engine process, its one spawned child."""
    engine = _spawned_children(serve_pid)
    assert len(engine) <= 1, engine
    return [rank for pid in engine for rank in _spawned_children(pid)]


def _serve_tensor_parallel_process() -> tuple[subprocess.Popen, int]:
    """`asyncspec serve --tensor-parallel-size 2` on the CPU as a process, on a free port."""
    exe = Path(sys.executable).parent / "asyncspec"
    if not exe.exists():
        pytest.skip("the asyncspec console script is not installed in this environment")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(exe), "serve", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1", "--max-model-len", "512"]
    argv += ["--num-kv-blocks", "64"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True), port


def test_dead_tensor_parallel_worker_fails_the_stream_and_serve_exits_non_zero(prompts):
    """`asyncspec serve --tensor-parallel-size 2` as a process (the engine in its own, the ranks below it): a
    rank killed mid-stream ends the stream with INTERNAL naming the rank, and the server exits with status 1 (an
    orchestrator restarts it) instead of serving a broken engine."""
    proc, port = _serve_tensor_parallel_process()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        ranks = _tensor_parallel_ranks(proc.pid)
        assert len(ranks) == 2, ranks
        assert pb_grpc_stub(channel).GetModelInfo(pb.GetModelInfoRequest()).tensor_parallel_size == 2
        stream = pb_grpc_stub(channel).Generate(_request(prompts[0], 400), timeout=60)
        next(stream)  # the request runs
        os.kill(ranks[1], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "rank 1" in e.value.details(), e.value.details()
        assert proc.wait(30) == 1
        for pid in ranks:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[1][:3]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_rank_dying_before_any_request_makes_serve_exit_non_zero():
    """The engine loop runs from the moment the server is ready: a rank that dies while no request
    was ever sent is noticed, and the server exits 1."""
    proc, port = _serve_tensor_parallel_process()
    try:
        assert "serving" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while len(_tensor_parallel_ranks(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(_tensor_parallel_ranks(proc.pid)[0], signal.SIGKILL)
        assert proc.wait(20) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def pb_grpc_stub(channel):
    from asyncspec.v1 import asyncspec_pb2_grpc

    return asyncspec_pb2_grpc.GenerationStub(channel)


def test_a_server_with_its_model_in_a_worker_process_streams_the_engine_output(prompts):
    """--worker-process true: the model runs in a process of its own (the server's streams then never
    share an interpreter lock with it); 16 concurrent streams get the engine's tokens, the pool is freed."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = bundled_llm(**ENGINE).generate(prompts, params)
    server = ServerThread(engine_overrides=dict(worker_process=True, async_scheduling=True))
    try:
        results = _concurrent_streams(server, prompts, 16)
        assert {i: results.get(i) for i in range(16)} == {i: reference[i % len(prompts)].token_ids for i in range(16)}
        _wait_kv_free(server)
    finally:
        server.stop()


def test_a_server_with_its_engine_in_a_process_of_its_own(prompts):
    """engine_process: scheduling, output processing and the model run in another process, the server keeps
    only the gRPC work. 16 concurrent streams get the engine's tokens and text, the other RPCs read the
    engine's facts, a cancelled stream frees its KV, metrics follow the steps, and a drain stops the engine
    process."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = bundled_llm(**ENGINE).generate(prompts, params)
    server = ServerThread(engine_overrides=dict(async_scheduling=True), engine_process=True)
    engine_pid = server.server.engine.pid
    try:
        assert engine_pid is not None and engine_pid != os.getpid()
        results = _concurrent_streams(server, prompts, 16)
        assert {i: results.get(i) for i in range(16)} == {i: reference[i % len(prompts)].token_ids for i in range(16)}
        stub = server.stub()
        responses = list(stub.Generate(_request(prompts[0])))
        assert "".join(r.text for r in responses) == reference[0].text
        assert responses[-1].usage.completion_tokens == 12
        ids = list(stub.Tokenize(pb.TokenizeRequest(text="def main():\n")).token_ids)
        assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "def main():\n"
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size == 8192
        before = server.stats()["num_generation_tokens"]
        call = stub.Generate(_request(prompts[1], 200))
        next(call)
        call.cancel()
        stats = _wait_kv_free(server)
        assert stats["num_generation_tokens"] - before < 200  # aborted, not run to its end
        metrics = _metrics(server)
        steps = metrics["asyncspec:num_steps_total"]
        assert steps >= 12 and metrics["asyncspec:iteration_tokens_total_count"] == steps
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while _pid_alive(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived the drained server"
        time.sleep(0.05)


def test_engine_process_with_its_model_in_a_worker_process(prompts):
    """Three processes (server, engine, model): the engine's own worker starts under the engine process's
    signal handlers, serves, and is gone with the engine once the server drains."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = bundled_llm(**ENGINE).generate(prompts[:4], params)
    server = ServerThread(engine_overrides=dict(worker_process=True), engine_process=True)
    engine_pid = server.server.engine.pid
    try:
        results = _concurrent_streams(server, prompts[:4], 4)
        assert {i: results.get(i) for i in range(4)} == {i: reference[i].token_ids for i in range(4)}
        workers = [pid for pid in _child_pids(engine_pid) if _pid_alive(pid)]
        assert workers, "the model's worker process should be a child of the engine process"
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while any(_pid_alive(pid) for pid in [engine_pid, *workers]):
        assert time.monotonic() < deadline, "the engine or its worker outlived the drained server"
        time.sleep(0.05)


def _child_pids(pid: int) -> list[int]:
    """Processes that multiprocessing spawned from `pid` (not its resource tracker)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) != pid:
                continue
            if b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def test_a_killed_engine_process_ends_streams_with_internal_and_health_not_serving(prompts):
    server = ServerThread(engine_process=True)
    try:
        stub = server.stub()
        call = stub.Generate(_request(prompts[0], 200), timeout=30)
        next(call)
        os.kill(server.server.engine.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "engine process exited" in e.value.details()
        _wait_not_ready(server, 5.0)
        assert server.server.engine_failed.is_set()
    finally:
        server.stop()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child still answers kill(0); it is gone once reaped or when its state is Z.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "in-process"])
def test_a_signal_while_the_model_loads_stops_serve_at_once(engine_process: bool):
    """SIGTERM during the model's load (minutes for a large GPU model) exits 0 at once, without ever serving, and
    the engine process goes with it; before, the signal waited for the load, and a pod outlived its grace."""
    exe = Path(sys.executable).parent / "asyncspec"
    if not exe.exists():
        pytest.skip("the asyncspec console script is not installed in this environment")
    argv = [str(exe), "serve", "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--metrics-port", "-1", "--engine-process", str(engine_process).lower(), "--num-kv-blocks", "64"]
    argv += ["--max-model-len", "256"]  # an engine that could start: the signal, not an error, ends the load
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "loading the engine" in line:
                break
        time.sleep(0.3)  # the engine process is spawned; its model takes seconds more to load
        engine = _spawned_children(proc.pid)
        assert len(engine) == (1 if engine_process else 0), engine
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert "stopping before the engine was ready" in err and "serving" not in out, (out, err[-2000:])
        assert time.monotonic() - started < 5
        assert not any(_pid_alive(pid) for pid in engine)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
