"""The OpenAI-compatible HTTP server (`swiftkv serve`): FastAPI + uvicorn, as vLLM's api_server.

    swiftkv serve [MODEL] --host 127.0.0.1 --port 8000
    python -m swiftkv_fast.entrypoints.api_server [MODEL] ...     # the same

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (with --api-key, every /v1
route needs "Authorization: Bearer KEY"), GET /health (200, or 503 once the engine is dead),
GET /version, GET /metrics (Prometheus text, see entrypoints.metrics). docs/serving.md has examples.

Requests are guarded before any work (middleware.py, request_body.py): a body over
--max-request-body-bytes is a 413, a content type other than application/json a 415, anything that
is not a valid request a 400; CORS headers only for --allowed-origins. A bug is a 500 naming an id
that the log's traceback carries.

`build_app(engine, config, registry)` is the app alone (tests drive it in-process); `run_server(args)`
binds the socket first (a port in use fails before the model loads), loads the model, then serves
until SIGINT / SIGTERM or the engine's death (launcher.py: the exit status) and stops the engine.
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from swiftkv_fast import __version__
from swiftkv_fast.engine.async_llm import AsyncLLM
from swiftkv_fast.entrypoints.errors import APIError
from swiftkv_fast.entrypoints.limits import default_max_request_body_bytes
from swiftkv_fast.entrypoints.middleware import (
    APIKeyMiddleware,
    InternalErrorMiddleware,
    RequestBodyLimitMiddleware,
)
from swiftkv_fast.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from swiftkv_fast.entrypoints.request_body import parse_body
from swiftkv_fast.entrypoints.serving_chat import OpenAIServingChat
from swiftkv_fast.entrypoints.serving_completion import OpenAIServingCompletion
from swiftkv_fast.entrypoints.serving_engine import ServerConfig
from swiftkv_fast.entrypoints.utils import run_unless_disconnected
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app(engine: AsyncLLM, config: ServerConfig, registry: CollectorRegistry | None = None) -> FastAPI:
    app = FastAPI(title="SwiftKV", version=__version__)
    tokenizer_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swiftkv-tokenizer")
    completions = OpenAIServingCompletion(engine, config, tokenizer_executor)
    chat = OpenAIServingChat(engine, config, tokenizer_executor)
    # the last added runs first: CORS (preflights), the body limit, the key, then bugs -> 500
    app.add_middleware(InternalErrorMiddleware)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    max_body = config.max_request_body_bytes or default_max_request_body_bytes(engine.max_model_len)
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=max_body)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = f"{e.detail}: {request.method} {request.url.path}"
        return APIError(message, e.status_code, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return APIError(str(e), 400).response()

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return APIError(
                f"the engine is not running: {engine.dead_error}", 503, code="engine_dead"
            ).response()
        return Response(status_code=200)

    kernel_plan = engine.engine.get_kernel_plan()  # fixed for the engine's lifetime

    @app.get("/version")
    async def version():
        return {"version": __version__, "kernel_plan": kernel_plan}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry) if registry else b"", media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        cards = [
            ModelCard(id=name, root=config.model_root, max_model_len=engine.max_model_len)
            for name in config.served_model_names
        ]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request):
        request = await parse_body(raw_request, CompletionRequest)
        return await _respond(raw_request, completions.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request):
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await _respond(raw_request, chat.create_chat_completion(request))

    return app


async def _respond(raw_request: Request, handler) -> Response:
    """A stream as server-sent events; a whole response as JSON, unless the client left first."""
    result = await run_unless_disconnected(raw_request, handler)
    if result is None:  # the client disconnected: its requests were aborted
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); OSError when the address is in use."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def run_server(args, engine_kwargs: dict) -> int:
    """`swiftkv serve`: args has model, host, port, api_key, max_waiting, max_sequences_per_request,
    max_request_body_bytes, allowed_origins, keep_alive_on_engine_death, served_model_name,
    uvicorn_log_level; engine_kwargs go to `LLM`. -> the exit status (launcher.py)."""
    import prometheus_client

    from swiftkv_fast.entrypoints.launcher import exit_signals_consumed, serve_http
    from swiftkv_fast.entrypoints.metrics import PrometheusStatLogger, make_registry
    from swiftkv_fast.llm import LLM

    prometheus_client.disable_created_metrics()  # no *_created series (vLLM does the same)
    names = args.served_model_name or [args.model or EMBEDDED_MODEL_NAME]
    config = ServerConfig(
        names,
        model_root=args.model,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_body_bytes=args.max_request_body_bytes,
        allowed_origins=args.allowed_origins or [],
    )
    sock = bind_socket(args.host, args.port)
    try:
        llm = LLM(args.model, **engine_kwargs)
        registry = make_registry()
        engine = AsyncLLM(llm.llm_engine, [PrometheusStatLogger(names[0], registry)])
        try:
            app = build_app(engine, config, registry)
            host, port = sock.getsockname()[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            logger.info("serving %s on %s (OpenAI API under /v1; Ctrl-C stops)", names[0], url)
            with exit_signals_consumed():
                return asyncio.run(
                    serve_http(app, sock, engine, args.uvicorn_log_level, args.keep_alive_on_engine_death)
                )
        finally:
            engine.shutdown()
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m swiftkv_fast.entrypoints.api_server ARGS` is `swiftkv serve ARGS`."""
    import sys

    from swiftkv_fast.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
