"""`jaxserve serve`: load the model, compile every bucket, then serve HTTP until SIGINT/SIGTERM.

`jaxserve/cli.py` (the composition root) registers the subcommand with `add_serve_parser` and
hands it the function that starts the engine; importing this module is cheap (the server is
imported when `serve` runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxserve.engine_client import EngineClient
from jaxserve.sampling_params import POOLING_KINDS
from server.config import ServerConfig
from server.reasoning import REASONING_PARSERS
from server.tls import TLSConfigError, add_https_args, https_context
from sharding.multihost import add_distributed_arguments

# Starts the engine that the command's flags describe: None in a multi-process job's followers,
# which have replayed the leader's steps until it stopped.
StartEngine = Callable[..., EngineClient | None]


def add_serve_parser(
    subparsers: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add `serve` (engine flags from `add_engine_args`, server flags from here), run by `run`
    (the composition root's: `serve` below, or the replica groups of a multi-process job)."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with sessions")
    add_engine_args(p)
    add_server_args(p.add_argument_group("server"))
    add_distributed_arguments(
        p.add_argument_group(
            "multi-process (one engine over several hosts, or data-parallel replicas on several processes)"
        )
    )
    p.set_defaults(func=run)
    return p


def add_server_args(g: argparse._ArgumentGroup) -> None:
    """The flags of the public server, which `jaxserve serve` and `jaxserve router` share."""
    defaults = ServerConfig()
    _add_listen_args(g, defaults)
    _add_limit_args(g, defaults)
    _add_session_args(g, defaults)
    _add_reply_args(g, defaults)


def _add_listen_args(g: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Where it listens, who may call it, and its shutdown."""
    g.add_argument("--host", default=defaults.host)
    g.add_argument("--port", type=int, default=defaults.port)
    g.add_argument(
        "--grpc-port",
        type=int,
        default=defaults.grpc_port,
        help="also serve the gRPC API (server/grpc_api/jaxserve.proto) on this port, 0 = off",
    )
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    g.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable)")
    g.add_argument("--api-key-file", default=None, help="file with one accepted key per line")
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT; then their streams end "
        "with an error event and [DONE]",
    )
    add_https_args(g)


def _add_limit_args(g: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Rate limits, admission, request sizes and timeouts."""
    g.add_argument(
        "--rate-limit-rpm", type=int, default=defaults.rate_limit_rpm, help="requests/minute per key, 0 = off"
    )
    g.add_argument(
        "--rate-limit-tpm", type=int, default=defaults.rate_limit_tpm, help="generated tokens/minute per key, 0 = off"
    )
    g.add_argument(
        "--max-waiting-seqs",
        type=int,
        default=defaults.max_waiting_seqs,
        help="sequences that may wait beyond --max-num-seqs before requests get 503",
    )
    g.add_argument(
        "--max-queue-wait",
        type=float,
        default=defaults.max_queue_wait,
        help="seconds a request may wait for one of the --max-num-seqs running slots (in priority order, then "
        "arrival) before it gets 503 with Retry-After instead of running late; 0 = off (requests wait in the "
        "engine's queue without a deadline)",
    )
    g.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    g.add_argument("--max-n", type=int, default=defaults.max_n)
    g.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: the context)")
    g.add_argument("--max-prompts", type=int, default=defaults.max_prompts)
    g.add_argument("--max-images-per-request", type=int, default=defaults.max_images_per_request)
    g.add_argument("--max-image-bytes", type=int, default=defaults.max_image_bytes)
    g.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels)
    g.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        help="a directory whose files chat images may name as file:// URLs (default: none; remote URLs never)",
    )
    g.add_argument("--request-timeout", type=float, default=defaults.request_timeout, help="seconds, 0 = none")
    g.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout,
        help="seconds a client may take to send a request body (then 408)",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=float,
        default=defaults.keepalive_timeout,
        help="seconds an idle keep-alive connection stays open",
    )


def _add_session_args(g: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Sessions and stored responses."""
    g.add_argument("--session-dir", type=Path, default=None, help="persist sessions as JSON files here")
    g.add_argument("--session-ttl", type=float, default=defaults.session_ttl, help="idle seconds before expiry")
    g.add_argument("--max-sessions-per-key", type=int, default=defaults.max_sessions_per_key)
    g.add_argument("--max-session-messages", type=int, default=defaults.max_session_messages)
    g.add_argument(
        "--session-pin-blocks-per-key",
        type=int,
        default=None,
        help="KV blocks one key's sessions may pin (default: the KV manager's)",
    )
    g.add_argument(
        "--response-ttl",
        type=float,
        default=defaults.response_ttl,
        help="idle seconds before a stored response (/v1/responses, store: true) expires",
    )
    g.add_argument(
        "--max-stored-responses-per-key",
        type=int,
        default=defaults.max_stored_responses_per_key,
        help="stored responses one key keeps; beyond it, its least recently used idle ones are deleted",
    )


def _add_reply_args(g: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """How replies are shaped: embeddings' pooling, schemas, reasoning, the chat template."""
    g.add_argument(
        "--embedding-pooling",
        choices=POOLING_KINDS,
        default=defaults.embedding_pooling,
        help="a decoder LM's embeddings (/v1/embeddings): the last prompt token's final hidden "
        "state, the mean of every token's, or the first token's; normalized (an encoder embedding "
        "model pools as its own config says)",
    )
    g.add_argument(
        "--no-strict-schemas",
        dest="strict_schemas",
        action="store_false",
        help="plain JSON Schema for tool parameters and json_schema formats: objects may hold properties "
        "they do not list (by default they may not unless additionalProperties allows them)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a thinking model's <think>...</think> into reasoning_content (chat), reasoning items "
        "(Responses) and thinking blocks (Messages); openai_gptoss: gpt-oss's harmony channels, which a harmony "
        "chat template's replies are read as without the flag too",
    )
    g.add_argument(
        "--chat-template", default=None, help="a jinja chat template (a file, or the text) instead of the model's"
    )


def server_config_from_args(args: argparse.Namespace, model_name: str | None = None) -> ServerConfig:
    """The server settings; the served name defaults to `model_name` (else the --model's)."""
    from server.auth import read_key_file

    keys = list(args.api_key)
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        served_model_name=args.served_model_name or Path(str(model_name or args.model)).name,
        api_keys=tuple(keys),
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm,
        max_waiting_seqs=args.max_waiting_seqs,
        max_queue_wait=args.max_queue_wait,
        max_body_bytes=args.max_body_bytes,
        max_n=args.max_n,
        max_tokens_limit=args.max_tokens_limit,
        max_prompts=args.max_prompts,
        max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        allowed_local_media_path=args.allowed_local_media_path,
        request_timeout=args.request_timeout,
        body_timeout=args.body_timeout,
        keepalive_timeout=args.keepalive_timeout,
        session_dir=args.session_dir,
        session_ttl=args.session_ttl,
        max_sessions_per_key=args.max_sessions_per_key,
        max_session_messages=args.max_session_messages,
        session_pin_blocks_per_key=args.session_pin_blocks_per_key,
        response_ttl=args.response_ttl,
        max_stored_responses_per_key=args.max_stored_responses_per_key,
        embedding_pooling=args.embedding_pooling,
        shutdown_timeout=args.shutdown_timeout,
        strict_schemas=args.strict_schemas,
        reasoning_parser=args.reasoning_parser,
        chat_template=_chat_template(args.chat_template),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
    )
    _https_context(config)  # a wrong file stops the command now, before the model loads
    return config


def _https_context(config: ServerConfig) -> Any:
    """The `ssl.SSLContext` of --ssl-*, None for plain HTTP; SystemExit naming a wrong file."""
    try:
        return https_context(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    except TLSConfigError as e:
        raise SystemExit(str(e)) from None


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (as vLLM reads it)."""
    if value is None or "{" in value:
        return value
    return Path(value).read_text()


def serve(args: argparse.Namespace, start_engine: StartEngine) -> int:
    """Start the engine, serve until SIGTERM/SIGINT; returns 0 after a graceful shutdown, 1 when
    the engine failed. In a multi-process job of one engine, process 0 serves HTTP and the others
    replay its device operations until it stops."""
    import asyncio

    from aiohttp import web

    from server.app import build_app

    config = server_config_from_args(args)
    engine = start_engine()
    if engine is None:
        return 0

    async def stop_engine(_app: web.Application) -> None:
        """Stop the engine while the event loop still runs: its last deliveries land."""
        await engine.aclose()

    try:
        app = build_app(engine, config)
        if config.grpc_port:
            from server.grpc_api.server import GrpcServer

            GrpcServer(config.host, config.grpc_port).attach(app)
        app.on_cleanup.append(stop_engine)  # after the app's own cleanup (sessions written)
        run_app(app, config)
    finally:
        asyncio.run(engine.aclose())  # already stopped unless the app failed to start
    if engine.fatal_error is not None:
        print(f"server stopped: the engine failed ({engine.fatal_error!r})", flush=True)
        return 1
    print("server stopped", flush=True)
    return 0


def run_app(app: Any, config: ServerConfig) -> None:
    """Serve `app` (or the coroutine that builds it) until SIGINT/SIGTERM, as `serve` and `router` do."""
    from aiohttp import web

    from server.app import FINAL_WRITE_SECONDS

    web.run_app(
        app,
        host=config.host,
        port=config.port,
        ssl_context=_https_context(config),
        shutdown_timeout=FINAL_WRITE_SECONDS,  # the app's drain already waited --shutdown-timeout
        keepalive_timeout=config.keepalive_timeout,
        lingering_time=config.body_timeout,  # how long an unread body is drained after a refusal
        handler_cancellation=True,
        access_log=None,
        print=lambda msg: print(msg.splitlines()[0], flush=True),
    )
