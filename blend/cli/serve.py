"""`kvblend serve`: the OpenAI-compatible HTTP server (blend.server) over one engine, and
`kvblend bench serve`.

OpenMP's wait policy is left to the environment (OMP_WAIT_POLICY). Both once set PASSIVE:
with the engine built on the main thread its OpenMP pool sat beside the scheduler's, idle
workers spun on shared cores and starved the event loop and the loader. Since only the
scheduler's thread runs parallel work (storage.openmp), libgomp's default (spin briefly,
then sleep) measured faster on this 2-core machine (bench serve, 8 clients, 3 documents,
128 tokens): decode step 42 ms at batch 1 and 82 ms at a mean batch of 4.1 against 68 and
157 ms with PASSIVE; tokens/s 18.4 and 30.9 against 11.6 and 17.4; server TTFT 0.56 s
against 0.84 s; no request lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from blend.cli.common import (
    RATIO,
    arg_type,
    check_out_dir,
    config_arg,
    emit_json,
    json_arg,
    non_negative_float,
    positive_float,
    positive_int,
    positive_ints,
)

log = logging.getLogger(__name__)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise ValueError(f"a port must be within 1..65535, got {value}")
    return value


def _body_bytes(text: str) -> int:
    from storage.units import parse_bytes

    value = parse_bytes(text, "--max-body")
    if value < 1:
        raise ValueError(f"--max-body must be at least 1 byte, got {text!r}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from blend.engine.engine import BlendEngine
    from blend.server import listen_socket, serve
    from blend.server.state import SHUTDOWN_STOP_S, ServerSettings

    sock = listen_socket(args.host, args.port)  # before the model loads: a taken port fails at once
    try:
        overrides = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
        if args.prefill_chunk_tokens is not None:
            overrides["prefill_chunk_tokens"] = args.prefill_chunk_tokens
        engine = BlendEngine.from_config(args.config, **overrides)
        settings = ServerSettings(served_model_name=args.served_model_name or engine.config.model,
                                  queue_size=args.queue_size, request_timeout_s=args.request_timeout,
                                  warmup=not args.no_warmup, max_body_bytes=args.max_body,
                                  shutdown_grace_s=args.shutdown_grace,
                                  completions_prompt=args.completions_prompt)
    except BaseException:
        sock.close()
        raise
    print(f"kvblend: serving {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(up to {engine.scheduler.config.max_num_seqs} sequences decoding together, queue {settings.queue_size}, "
          f"timeout {settings.request_timeout_s:g} s)", flush=True)
    code = 0
    if serve(engine, settings, sock, log_level="info" if args.verbose else "warning"):
        print("kvblend: stopped at once by a second signal: requests in flight ended with an error", file=sys.stderr)
        code = 130
    if not engine.scheduler.stop(SHUTDOWN_STOP_S):  # (stopped already: this waits for a step still under way)
        # the store is flushed and closed; an interpreter exit beside a thread inside torch's kernels aborts
        print(f"kvblend: the scheduler was still in a step {2 * SHUTDOWN_STOP_S:g} s after the shutdown; "
              "exiting without it", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(code)
    return code


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, documents, metrics)",
                              description="Serve the engine over HTTP: /v1/chat/completions, /v1/completions, "
                              "/v1/documents, /v1/models, /health, /metrics. Requests share the model through a "
                              "scheduler: up to --max-num-seqs sequences decode together (one batched step), "
                              "prefills run between decode steps; others wait in a bounded queue.")
    config_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=arg_type(_port), default=8000, help="port (default 8000)")
    p.add_argument("--queue-size", type=arg_type(positive_int), default=64,
                   help="requests that may wait for the scheduler; more get 503 + Retry-After (default 64)")
    p.add_argument("--max-num-seqs", type=arg_type(positive_int), default=None,
                   help="sequences decoding together at most (default: the config's engine.scheduler.max_num_seqs, "
                   "$KVBLEND_MAX_NUM_SEQS, else 8 on CPU and 32 on CUDA)")
    p.add_argument("--prefill-chunk-tokens", type=arg_type(positive_int), default=None,
                   help="a prefill's rows per scheduler step, every running sequence's next token computed "
                   "alongside (default: the config's engine.prefill_chunk_tokens, $KVBLEND_PREFILL_CHUNK_TOKENS)")
    p.add_argument("--request-timeout", type=arg_type(positive_float), default=300.0,
                   help="seconds from acceptance to the last token before a request is cancelled (default 300)")
    p.add_argument("--shutdown-grace", type=arg_type(non_negative_float), default=20.0,
                   help="seconds the requests in flight or queued have to finish after SIGTERM / SIGINT; then "
                   "each ends with an error (503) and the server exits after at most 10 s for the step under "
                   "way and 10 s for the queued cache writes (default 20)")
    p.add_argument("--max-body", type=arg_type(_body_bytes), default=16 << 20,
                   help="largest request body, e.g. 16MiB (default); larger ones get 413 before parsing")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the config's model)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at start")
    p.add_argument("--completions-prompt", choices=("question", "raw"), default="question",
                   help="what /v1/completions' prompt is: the question of kvblend's RAG prompt (default), or raw: "
                   "the whole prompt as text, tokenized as it is, run in full (or prefix) mode, as OpenAI-style "
                   "servers take it (e.g. as the peer of `kvblend bench serve --peer`)")
    p.set_defaults(func=cmd_serve)


# ------------------------------------------------------------ bench serve
def cmd_bench_serve(args: argparse.Namespace) -> int:
    from blend.config import check_mode
    from eval.bench.peer import Peer
    from eval.bench.serve import KVBLEND, REPORT_FILES, run_serve_bench, write_report

    modes = [check_mode(m.strip()) for m in args.mode.split(",")]
    check_out_dir(args.out, REPORT_FILES)
    peer = None
    if args.peer:
        name = args.peer_name or "peer"
        if not name.strip() or name == KVBLEND:
            raise ValueError(f"--peer-name {name!r} must name the peer (not empty, not {KVBLEND!r})")
        peer = Peer(_server_url(args.peer, "--peer"), name, dict(args.peer_setting or []), args.peer_prompt)
    elif args.peer_name or args.peer_setting or args.peer_prompt != "text":
        raise ValueError("--peer-name, --peer-setting and --peer-prompt describe a --peer; give --peer URL too")
    clients = positive_ints(args.clients, "--clients")
    settings = positive_ints(args.max_num_seqs, "--max-num-seqs") if args.max_num_seqs else [None]
    url = _server_url(args.url, "--url") if args.url else None
    if url and args.max_num_seqs:
        raise ValueError("--max-num-seqs starts a server per setting; it cannot be used with --url (a running "
                         "server has its own setting)")
    say = (lambda _: None) if args.json else (lambda line: print(line, flush=True))
    summary = run_serve_bench(args.config, clients=clients, requests=args.requests, pool_size=args.pool,
                              docs_per_request=args.docs_per_request, max_tokens=args.max_tokens,
                              doc_chars=args.doc_chars, mode=modes, ratio=args.ratio, url=url,
                              compare=not args.no_compare, max_num_seqs=settings, peer=peer, log=say)
    pair = (summary["in_process"] or {}).get("pair_ratio")
    say(f"CPU probe {summary['probe_gflops_start']} -> {summary['probe_gflops_end']} GFLOP/s; load average "
        f"{summary['load_average_start']} at start, {summary['load_average_peak']} at its peak"
        + (f"; HTTP / in-process TTFT per request {pair['min']}-{pair['max']} (median {pair['median']})" if pair else ""))
    if args.out:
        write_report(summary, Path(args.out))
        say(f"wrote {Path(args.out) / 'serve.json'}, serve.png and serve-levels.png")
    for row in summary["speedups"]:
        say(f"{row['clients']} clients, {row['mode']}: max_num_seqs {row['max_num_seqs']} vs {row['versus']}: tokens/s x"
            f"{row['tokens_per_s_ratio']}, TTFT p50 x{row['ttft_p50_ratio']}")
    emit_json(summary)
    return 0


def _server_url(text: str, flag: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {text!r} is not a server URL; use e.g. http://127.0.0.1:8000")
    return text.rstrip("/")


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--peer-setting {text!r} is not KEY=VALUE; use e.g. threads=2")
    return key.strip(), value.strip()


def register_bench(sub: Any) -> None:
    """`kvblend bench serve` (registered by blend.cli.bench)."""
    p = sub.add_parser("serve", help="RAG requests through the HTTP server at 1, 4, 16 concurrent clients "
                       "(and several --max-num-seqs)",
                       description="Start `kvblend serve` (or use --url), ingest a pool of sample documents, send "
                       "streamed RAG chat requests from N concurrent clients; report requests/s, TTFT p50/p99, "
                       "tokens/s, hit rate, and at 1 client the in-process API's TTFT for comparison.")
    config_arg(p)
    p.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    p.add_argument("--requests", type=arg_type(positive_int), default=16, help="requests per level (default 16)")
    p.add_argument("--pool", type=arg_type(positive_int), default=None, help="documents in the pool (default: all samples)")
    p.add_argument("--docs-per-request", type=arg_type(positive_int), default=3)
    p.add_argument("--doc-chars", type=arg_type(positive_int), default=None, help="cut each document to this many characters")
    p.add_argument("--max-tokens", type=arg_type(positive_int), default=16)
    p.add_argument("--mode", default="blend", help="full | reuse | prefix | blend, or several comma-separated "
                   "(e.g. full,blend: a row per mode, the same requests; default blend)")
    p.add_argument("--ratio", type=RATIO, default=None, help="recompute ratio in [0, 1] (default: the config's)")
    p.add_argument("--max-num-seqs", default=None,
                   help="comma-separated scheduler settings (e.g. 1,8): the same requests under each, one server per "
                   "setting (default: the config's)")
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--no-compare", action="store_true", help="skip the in-process TTFT comparison at 1 client")
    p.add_argument("--peer", default=None, metavar="URL",
                   help="also send the same requests to this OpenAI-compatible server (llama-server, vLLM, SGLang, "
                   "`kvblend serve --completions-prompt raw`): each prompt as kvblend builds it, as text, to its "
                   "/v1/completions, greedy; its rows sit beside kvblend's")
    p.add_argument("--peer-name", default=None, metavar="NAME", help="the peer's name in the rows (default: peer)")
    p.add_argument("--peer-setting", action="append", type=arg_type(_setting), default=None, metavar="KEY=VALUE",
                   help="one of the peer's own settings to record in its rows (repeatable), e.g. np=8")
    p.add_argument("--peer-prompt", choices=("text", "ids"), default="text",
                   help="how the peer gets each prompt: text (default: what users send; it tokenizes it itself) or "
                   "ids (kvblend's own token ids: the same tokens, so only the numerics differ)")
    json_arg(p, "print only the JSON result line")
    p.add_argument("--out", default=None, help="directory for serve.json and serve.png")
    p.set_defaults(func=cmd_bench_serve)
