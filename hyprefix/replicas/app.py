"""The Ray Serve application: ``EngineReplica`` (one engine each) behind ``Ingress`` (the
OpenAI-compatible FastAPI app of the single-process server, over ``ReplicaSetBackend``).

A generation call goes ingress -> (this process's ``PrefixAwareRequestRouter``) ->
replica: a unary call answering the whole JSON answer or its error, or for a stream
a streaming call whose first item is ``{"kind": "stream"}`` or the error, so errors
keep their status and a stream starts only once the request is accepted. Cancelling
the call (the client left) cancels the replica's handler, which aborts its engine
requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from hyprefix.catalog import DEFAULT_MODEL
from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from hyprefix.errors import RequestError
from hyprefix.kv_events import KVEventsConfig
from hyprefix.metrics import ROUTER_METRICS, merge_expositions
from hyprefix.replicas.router import METADATA_KEY, ROUTING_KWARG
from hyprefix.routing.policy import RoutingRule
from hyprefix.routing.request_key import RequestHasher, RoutingKey
from hyprefix.server.api import build_openai_app
from hyprefix.server.args import ServerArgs
from hyprefix.server.backend import Answer, LocalBackend
from hyprefix.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from hyprefix.server.responses import DetokenizeResponse, TokenizeResponse, sse
from hyprefix.server.serving import Tokenization, as_api_error, engine_salt, finalize_on_gc
from hyprefix.server.status import merge_status
from hyprefix.text import chat_token_ids

log = logging.getLogger("hyprefix.replicas")

@dataclass
class ReplicasConfig:
    """What ``build_replicas_app`` deploys: ``server.replicas`` engines of ``engine``, routed by
    ``server.replica_router`` (``prefix``, ours, or ``pow2``, Ray Serve's default
    power-of-two-choices, blind to prefixes: the baseline), served with ``server``'s options."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    server: ServerArgs = field(default_factory=lambda: ServerArgs(replicas=2))
    max_ongoing_requests: int = 1024  # per replica; the engine queues what it cannot batch

    def __post_init__(self) -> None:
        if self.server.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.server.replicas}")

    @property
    def names(self) -> list[str]:
        return self.server.model_names or [self.engine.model or DEFAULT_MODEL]

    @property
    def rule(self) -> RoutingRule:
        s = self.server
        return RoutingRule(s.routing_balance_abs, s.routing_balance_rel, s.routing_min_match)


def _error_item(error: APIError) -> dict[str, Any]:
    return {"kind": "error", "error": {"status": error.status, "message": error.message, "type": error.type,
                                       "param": error.param, "code": error.code}}


class EngineReplica:
    """One engine (on its own thread, as in ``hyprefix serve``) in a Ray Serve replica.
    With prefix routing it publishes its KV cache events on ephemeral ports of its node
    and reports them in its replica metadata."""

    def __init__(self, config: ReplicasConfig) -> None:
        import torch

        torch.set_num_threads(max(1, int(config.server.replica_cpus or 1)))
        _renice_to_normal()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        args = config.engine
        if config.server.replica_router == "prefix":
            args = dataclasses.replace(args, kv_events_config=_replica_events_config(args.kv_events_config))
        engine = Engine(args)
        engine.warmup()
        self.engine = engine
        self.backend = LocalBackend(engine, config.names, config.server.limits, replica=self.replica_id,
                                    chat=config.server.chat)
        self._started = False

    def _start(self) -> None:
        if not self._started:  # on the replica's event loop: the engine's outputs come back to it
            self.backend.start()
            self._started = True

    def record_replica_metadata(self) -> dict[str, Any]:
        endpoints = self.engine.kv_events_endpoints()
        return {METADATA_KEY: endpoints} if endpoints is not None else {}

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs: the served names, and what it takes to hash a prompt
        as this engine does (its tokenizer travels pickled: no path needs to exist there)."""
        engine = self.engine
        return {"model_names": self.backend.model_names, "max_model_len": engine.max_model_len,
                "model_identity": engine.model_identity, "block_size": engine.args.block_size,
                "tokenizer": engine.tokenizer, "vocab_size": engine.vocab_size}

    async def answer(self, kind: str, body: CompletionRequest | ChatCompletionRequest, tenant: str | None,
                     routing: RoutingKey | None = None) -> dict[str, Any]:
        """A request without ``stream``: its whole answer, or its error."""
        try:
            return {"kind": "json", "body": (await self._serve(kind, body, tenant)).model_dump()}
        except Exception as exc:
            return _error_item(as_api_error(exc))

    async def generate(self, kind: str, body: CompletionRequest | ChatCompletionRequest, tenant: str | None,
                       routing: RoutingKey | None = None) -> AsyncIterator[Any]:
        """A request with ``stream``: first ``{"kind": "stream"}`` (or its error), then its SSE events."""
        try:
            events = await self._serve(kind, body, tenant)
        except Exception as exc:
            yield _error_item(as_api_error(exc))
            return
        yield {"kind": "stream"}
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # a cancelled call: the stream's finally aborts its requests

    async def _serve(self, kind: str, body: Any, tenant: str | None) -> Any:
        self._start()
        return await (self.backend.completions if kind == "completions" else self.backend.chat)(body, tenant)

    async def health(self) -> str:
        self._start()
        return await self.backend.health()

    async def metrics_text(self) -> bytes:
        return await self.backend.metrics_text()

    async def status(self) -> dict[str, Any]:
        return await self.backend.status()

    async def reset_prefix_cache(self) -> int:
        self._start()
        return await self.backend.reset_prefix_cache()

    async def control(self, method: str, *args: Any) -> dict[str, Any]:
        """Generation control (``server/control.py``): ``{"kind": "ok", "result", "model_identity"}``
        or the error item. An update answers the engine's new model identity, which the
        ingress hashes prompts with from then on."""
        self._start()
        try:
            result = await getattr(self.backend, method)(*args)
        except Exception as exc:
            return _error_item(as_api_error(exc))
        return {"kind": "ok", "result": result, "model_identity": self.engine.model_identity}

    def __del__(self) -> None:  # Ray Serve calls it when the replica stops
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.async_engine.shutdown()
            self.engine.close()


def _renice_to_normal() -> None:
    """Run this replica's threads (the engine thread starts from one of them and inherits
    it) at niceness 0 where Ray started the worker nicer (its ``worker_niceness``, 15 unless
    ``run_replicas`` started the cluster): a nice engine loses its CPU to every ordinary
    process beside it. Raising priority may be refused (no CAP_SYS_NICE): then a warning."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return
    try:
        for tid in os.listdir("/proc/self/task"):  # Linux: niceness is per thread
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (OSError, ValueError) as exc:
        log.warning("this engine replica runs at niceness %d (Ray's worker_niceness) and could not lower it (%s): "
                    "ordinary processes on its CPUs come first; start the cluster with RAY_worker_niceness=0",
                    niceness, exc)


def _replica_events_config(user: KVEventsConfig | None) -> KVEventsConfig:
    """The user's ``--kv-events-config`` (topics, buffer) on ephemeral ports of this node:
    N replicas may share a node, and the router learns the ports from the metadata."""
    from ray.util import get_node_ip_address

    host = get_node_ip_address()
    return dataclasses.replace(user or KVEventsConfig(), endpoint=f"tcp://{host}:*",
                               replay_endpoint=f"tcp://{host}:*", enable_kv_cache_events=True, publisher="zmq")


class ReplicaSetBackend:
    """``ServingBackend`` over the engine replicas' deployment handle."""

    def __init__(self, engines: DeploymentHandle, info: dict[str, Any]) -> None:
        self.engines = engines
        self.model_names: list[str] = info["model_names"]
        self.max_model_len: int = info["max_model_len"]
        self.hasher = RequestHasher(info["tokenizer"], info["model_identity"], info["block_size"])
        # /tokenize and /detokenize need no replica: the ingress holds the replicas' tokenizer
        self.tokenization = Tokenization(self.hasher.tokenizer, info["vocab_size"], self.max_model_len,
                                         self.model_names)

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def _broadcast(self, method: str) -> list[Any]:
        return await self.engines.broadcast(method).results_async(timeout_s=30, return_exceptions=True)

    async def health(self) -> str:
        """"ok" while at least one replica is (Ray Serve replaces the others)."""
        statuses = [s if isinstance(s, str) else "unreachable" for s in await self._broadcast("health")]
        if "ok" in statuses:
            return "ok"
        return statuses[0] if statuses else "no replicas"

    async def metrics_text(self) -> bytes:
        texts = [t for t in await self._broadcast("metrics_text") if isinstance(t, bytes)]
        return merge_expositions([*texts, ROUTER_METRICS.exposition()])

    async def status(self) -> dict[str, Any]:
        return merge_status([s for s in await self._broadcast("status") if isinstance(s, dict)])

    async def reset_prefix_cache(self) -> int:
        results = await self._broadcast("reset_prefix_cache")
        failed = [r for r in results if not isinstance(r, int)]
        if failed:
            raise APIError(503, f"{len(failed)} of {len(results)} replicas could not reset: {failed[0]!r}",
                           type="service_unavailable")
        return sum(results)

    async def _control(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every replica; raises the first replica's error. An update may wait
        for the requests in flight to finish: no time limit."""
        items = await self.engines.broadcast("control", method, *args).results_async(return_exceptions=True)
        for item in items:
            if not isinstance(item, dict):
                raise APIError(503, f"an engine replica failed: {item!r}", type="service_unavailable")
            if item["kind"] == "error":
                raise APIError(**item["error"])
        return items

    async def update_weights(self, model_path: str, weight_version: str | None,
                             abort_all_requests: bool) -> dict[str, Any]:
        items = await self._control("update_weights", model_path, weight_version, abort_all_requests)
        self.hasher = dataclasses.replace(self.hasher, model_identity=items[0]["model_identity"])
        return items[0]["result"]

    async def weight_version(self) -> str:
        return (await self._control("weight_version"))[0]["result"]

    async def pause(self, mode: str) -> int:
        return sum(item["result"] for item in await self._control("pause", mode))

    async def resume(self) -> None:
        await self._control("resume")

    async def abort(self, rid: str | None) -> int:
        return sum(item["result"] for item in await self._control("abort", rid))

    async def completions(self, body: CompletionRequest, tenant: str | None) -> Answer:
        def key() -> RoutingKey:  # a batch goes to one replica: routed by its first prompt
            return self.hasher.prompt_key(body.prompts()[0], engine_salt(body.cache_salt, tenant))

        return await self._call("completions", body, tenant, key)

    async def chat(self, body: ChatCompletionRequest, tenant: str | None) -> Answer:
        def key() -> RoutingKey:
            ids = chat_token_ids(self.hasher.tokenizer, body.chat_prompt())
            return self.hasher.key(ids, engine_salt(body.cache_salt, tenant))

        return await self._call("chat", body, tenant, key)

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await self.tokenization.tokenize(body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        return await self.tokenization.detokenize(body)

    async def _call(self, kind: str, body: Any, tenant: str | None, key: Callable[[], RoutingKey]) -> Answer:
        try:
            routing = key()
        except (RequestError, ValueError, TypeError):
            routing = RoutingKey()  # bad input: the replica answers the error
        kwargs = {ROUTING_KWARG: routing}
        if body.stream:
            call = self.engines.options(stream=True).generate.remote(kind, body, tenant, **kwargs)
            first = await _first(call, call.__anext__())
        else:  # one unary call: cheaper than a stream
            call = self.engines.answer.remote(kind, body, tenant, **kwargs)
            first = await _first(call, call)
        if first["kind"] == "error":
            raise APIError(**first["error"])
        if first["kind"] == "json":
            return first["body"]
        return finalize_on_gc(_relay(call), call.cancel)


async def _first(call: Any, first: Awaitable[Any]) -> Any:
    """The call's answer (or a stream's first item); a cancelled wait (the client left)
    cancels the call on its replica, which aborts its engine requests."""
    try:
        return await first
    except BaseException as exc:
        call.cancel()
        if isinstance(exc, Exception):
            raise APIError(503, f"no engine replica answered: {type(exc).__name__}: {exc}",
                           type="service_unavailable") from exc
        raise


async def _relay(call: DeploymentResponseGenerator) -> AsyncIterator[str]:
    """A replica's SSE events; a replica lost mid-stream ends it with an error event."""
    done = False
    try:
        async for event in call:
            yield event
        done = True
    except Exception as exc:
        done = True
        log.warning("an engine replica failed mid-stream: %r", exc)
        yield sse(APIError(503, f"the engine replica failed: {type(exc).__name__}",
                           type="service_unavailable").body())
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            call.cancel()


class Ingress:
    async def __init__(self, engines: DeploymentHandle, config: ReplicasConfig) -> None:
        self.config = config
        self.backend = ReplicaSetBackend(engines, await engines.describe.remote())

    def __serve_build_asgi_app__(self) -> Any:
        s = self.config.server
        return build_openai_app(self.backend, s.api_keys, s.limits, s.cache_per_key)


def build_replicas_app(config: ReplicasConfig) -> Any:
    """The Ray Serve application: ``serve.run(build_replicas_app(config), route_prefix="/")``
    after ``ray.init`` (how ``hyprefix serve --replicas N`` runs it)."""
    server = config.server
    if server.replica_cpus is None:
        server = dataclasses.replace(server, replica_cpus=default_replica_cpus(server.replicas))
        config = dataclasses.replace(config, server=server)
    router = None
    if server.replica_router == "prefix":
        rule = config.rule
        router = RequestRouterConfig(
            request_router_class="hyprefix.replicas.router:PrefixAwareRequestRouter",
            request_router_kwargs={"balance_abs": rule.balance_abs, "balance_rel": rule.balance_rel,
                                   "min_match": rule.min_match})
    options: dict[str, Any] = {"request_router_config": router} if router is not None else {}
    logging = {"enable_access_log": server.access_log}
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=server.replicas, max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": server.replica_cpus}, logging_config=logging, **options)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress").options(
        num_replicas=1, max_ongoing_requests=4 * server.replicas * config.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, logging_config=logging)
    return ingress.bind(engines.bind(config), config)


def default_replica_cpus(num_replicas: int) -> float:
    """The cluster's CPUs shared out (this machine's when Ray is not running yet)."""
    import ray

    cpus = ray.cluster_resources().get("CPU") if ray.is_initialized() else None
    return max(0.5, (cpus or os.cpu_count() or 1) / num_replicas)


def run_replicas(config: ReplicasConfig) -> None:
    """Start (or join, with ``server.ray_address``) a Ray cluster, deploy the app with Serve's
    HTTP proxy on ``server.host:server.port`` and serve until SIGINT/SIGTERM (blocking)."""
    import signal
    import threading
    import time

    import ray

    server = config.server
    t0 = time.perf_counter()
    # Ray starts its workers at niceness 15 (worker_niceness), so every process at 0 on the
    # same CPUs (a client, Ray's own daemons) would take an engine's CPU first.
    system = {"worker_niceness": 0} if server.ray_address is None else None
    ray.init(address=server.ray_address, include_dashboard=False, configure_logging=False, _system_config=system)
    try:
        serve.start(http_options={"host": server.host, "port": server.port},
                    logging_config={"enable_access_log": server.access_log})
        serve.run(build_replicas_app(config), name="hyprefix", route_prefix="/")
        log.info("serving %s on http://%s:%d with %d engine replicas (%s router), ready in %.1fs",
                 ", ".join(config.names), server.host, server.port, server.replicas, server.replica_router,
                 time.perf_counter() - t0)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down the replicas")
        serve.shutdown()
    finally:
        ray.shutdown()
