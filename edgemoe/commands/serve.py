"""`edgemoe serve`: an OpenAI-compatible HTTP API with continuous batching."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from edgemoe import options

from .common import load_served
from .options import (COMPUTE, DENSE_BITS, DEVICE, DTYPE, FALLBACK_BELOW, KV_DTYPE, MODEL, POLICY, PRELOAD, RAM,
                      SERVED_CONTEXT, SKIP_BELOW, THREADS, VRAM, as_store_options, checked)


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise options.OptionError(flag, value, "expected a TCP port in 0..65535")
    return value


def serve(
    model: Optional[Path] = MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", callback=checked(_port), help="TCP port (0: any free one)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Name clients pass as `model` "
                                             "(default: the directory's name)."),
    max_batch: int = typer.Option(16, "--max-batch", callback=checked(options.integer_at_least, 1),
                                  help="Requests sharing one forward step at most."),
    max_connections: int = typer.Option(256, "--max-connections", callback=checked(options.integer_at_least, 1),
                                        help="Connections served at once (a thread each); more wait to be "
                                             "accepted."),
    request_timeout: float = typer.Option(10.0, "--request-timeout", callback=checked(options.timeout_seconds),
                                          help="Seconds for a request's line, headers and body to arrive from "
                                               "its first byte (and for each write to a client to go out)."),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout",
                                             callback=checked(options.timeout_seconds),
                                             help="Seconds a connection may sit idle waiting for a request."),
    ram: Optional[str] = RAM,
    vram: Optional[str] = VRAM,
    device: Optional[str] = DEVICE,
    policy: str = POLICY,
    preload: str = PRELOAD,
    skip_below: float = SKIP_BELOW,
    fallback_below: float = FALLBACK_BELOW,
    compute: str = COMPUTE,
    dtype: str = DTYPE,
    dense_bits: str = DENSE_BITS,
    kv_dtype: str = KV_DTYPE,
    context: Optional[int] = SERVED_CONTEXT,
    threads: Optional[int] = THREADS,
):
    """OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) with continuous batching."""
    from edgemoe.server import serve as serve_http

    store_options = as_store_options(ram=ram, vram=vram, device=device, policy=policy, preload=preload,
                                     skip_below=skip_below, fallback_below=fallback_below, compute=compute)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    m = load_served(model, dtype, dense_bits, kv_dtype, threads, store_options, context, say=logging.info)
    serve_http(m, host, port, model_name=model_name, max_batch=max_batch, max_connections=max_connections,
               request_timeout=request_timeout, keep_alive_timeout=keep_alive_timeout)
