"""`kivi serve`: an OpenAI-compatible server with continuous batching over the KIVI cache."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from typing import Optional

from .args import (add_model_arguments, check_memory, check_weight_quant_modes, device_and_dtype,
                   kivi_config_from, non_negative_float, non_negative_int, positive_float, positive_int, positive_ints,
                   usage_errors)
from kivi_models.loading import DEFAULT_MODEL, DEFAULT_NAME, load_model, log
from kivi_serve.app import LOOPBACK_HOSTS, Server, build_app
from kivi_serve.config import MAX_REQUEST_BYTES, ServeConfig
from kivi_serve.connections import (READ_TIMEOUT, TIMEOUT_KEEP_ALIVE, ConnectionLimits, check_connection_limits,
                                    uvicorn_config)
from kivi_serve.watchdog import STALL_TIMEOUT

def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching over the cache)")
    add_model_arguments(s)
    s.add_argument("--max-batch", type=positive_int, default=None,
                   help="cache rows (concurrent requests); default 8 unless --cache-budget-gib (static), "
                        f"{PAGED_ROWS} with --paged")
    s.add_argument("--cache-budget-gib", type=positive_float, default=None,
                   help="static: as many rows as fit this many GiB of cache (exact bytes per row); --paged: as many "
                        "pages as fit (exact bytes per page, after the rows' own state)")
    s.add_argument("--paged", action=argparse.BooleanOptionalAction, default=None,
                   help="a pool of pages shared by the rows instead of a static row of --max-seq-len tokens per "
                        "request: admission by free pages, preemption by swapping to host memory (docs/serve.md); "
                        "default: on on CPU, off on CUDA (--no-paged: static rows)")
    s.add_argument("--num-pages", type=positive_int, default=None,
                   help="--paged: pages in the pool (per layer); default: as many as --cache-budget-gib holds, else "
                        f"the rows' own state plus the pages of {DEFAULT_SEQUENCES} sequences of --max-seq-len tokens")
    s.add_argument("--page-size", type=positive_int, default=None,
                   help="--paged: tokens per page (fp: default 16, as vLLM; KIVI: a multiple of --group-size)")
    s.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="--paged: requests that start with the same tokens share the pages of that prefix, which is "
                        "prefilled once (vLLM's automatic prefix caching); prompts are then prefilled in chunks of "
                        "--prefix-chunk tokens, so greedy outputs of prompts of R (--residual-length) tokens or more can differ "
                        "from `kivi generate`'s (--no-prefix-caching: they equal them; docs/serve.md); default: on with "
                        "--paged")
    s.add_argument("--prefix-chunk", type=positive_int, default=None,
                   help="--prefix-caching: the prefill chunk and the granularity of sharing, a multiple of the page "
                        f"size (default: {PREFIX_CHUNK} rounded up to a multiple of the page size)")
    s.add_argument("--prefix-cache-size", type=positive_int, default=None,
                   help="--prefix-caching: cached prefixes kept at most (each keeps a host copy of its tail: the row "
                        "state and unfinished pages), least recently used dropped first (default: as many as 4 GiB "
                        "of host memory holds, at most 256)")
    s.add_argument("--prefix-cache-gib", type=positive_float, default=None,
                   help="--prefix-caching: host memory the cached prefixes' tails may hold at most, least recently "
                        "used dropped first (default: as much as the cache itself, so the tails never outweigh it; "
                        "/metrics: kivi_prefix_cache_bytes)")
    s.add_argument("--decode-buckets", type=positive_ints, default=None,
                   help="--paged: the row counts a decode step may run over, each compiled once (e.g. 8,16,32); "
                        "requests are kept in the lowest rows and a step runs over the smallest bucket holding them, "
                        "so idle rows cost nothing (default: powers of two from 8 below --max-batch, the 7 largest, and --max-batch)")
    s.add_argument("--max-seq-len", type=positive_int, default=2048,
                   help="tokens per row: prompt + max_tokens of one request (at most the model's context)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients ask for (default: the model's directory name)")
    s.add_argument("--max-request-bytes", type=positive_int, default=MAX_REQUEST_BYTES,
                   help=f"largest request body; more is refused with 413 (default {MAX_REQUEST_BYTES})")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every path but /health (default: the KIVI_API_KEY "
                        "environment variable, which other users cannot read from the process list; none if unset)")
    s.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    s.add_argument("--max-waiting", type=non_negative_int, default=64,
                   help="requests queued for a slot at most; more are refused with 503 + Retry-After (default 64)")
    s.add_argument("--request-timeout", type=positive_float, default=None,
                   help="seconds a request may take from arrival, queue included; then it ends with 504 (default: none)")
    s.add_argument("--stall-timeout", type=positive_float, default=STALL_TIMEOUT,
                   help="seconds the engine may go without completing a step (a decode step, or one prompt's prefill) "
                        "while requests are open; then /health answers 503 engine_stalled and /metrics "
                        f"kivi_engine_stalled 1 until it moves (default {STALL_TIMEOUT:g}; docs/serve.md, Operations)")
    s.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before they end with an error; "
                        "a second signal ends them at once (default 30)")
    s.add_argument("--max-connections", type=positive_int, default=None,
                   help="open connections at most; one more closes the connection idle longest, or gets 503 when all "
                        "are in a request (default: the descriptor limit, ulimit -n, less those open and a reserve; docs/serve.md)")
    s.add_argument("--timeout-keep-alive", type=positive_float, default=TIMEOUT_KEEP_ALIVE,
                   help="seconds a connection with no request in progress (new, or between requests) stays open "
                        f"(default {TIMEOUT_KEEP_ALIVE:g}, as uvicorn)")
    s.add_argument("--read-timeout", type=positive_float, default=READ_TIMEOUT,
                   help="seconds a request's headers and body may take to arrive from its first byte; then 408 and "
                        f"the connection closes (default {READ_TIMEOUT:g})")
    s.add_argument("--tp-timeout", type=positive_float, default=120.0,
                   help="under torchrun: seconds any collective (a step, a plan, loading) may wait for the other "
                        "ranks before the server gives up on them and answers 503 (default 120; docs/parallel.md)")
    s.set_defaults(func=cmd_serve, parser=s)


def is_loopback(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine. An address is read as
    the socket layer reads it (inet_aton: "127.1" is 127.0.0.1, so is "0x7f.1"); of the names, only
    localhost is known to be loopback: another may resolve to anything."""
    host = host.strip("[]")
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        return False  # a name
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def access_settings(args, parser) -> tuple[Optional[str], Optional[tuple[str, ...]]]:
    """(the API key: --api-key, else KIVI_API_KEY, else None; the Host names a loopback bind answers,
    None for any). Warns when the port is open to other machines without a key."""
    api_key = args.api_key if args.api_key is not None else os.environ.get("KIVI_API_KEY")
    if api_key is not None and not api_key.strip():
        parser.error("--api-key (or KIVI_API_KEY) is empty; give a key or unset it")
    if api_key is not None and not all("!" <= c <= "~" for c in api_key):
        # A Bearer token travels in an HTTP header: clients send only visible ASCII there.
        parser.error("--api-key (or KIVI_API_KEY) must be printable ASCII without spaces (what an HTTP client can send "
                     "in 'Authorization: Bearer <key>')")
    if not is_loopback(args.host):
        if api_key is None:
            log(f"warning: --host {args.host} accepts connections from other machines and no --api-key (or "
                "KIVI_API_KEY) is set: anyone who can reach the port can use the model")
        return api_key, None
    return api_key, tuple(dict.fromkeys((*LOOPBACK_HOSTS, args.host.strip("[]"))))


PAGED_ROWS = 32  # --paged: default rows (the pool, not the rows, bounds how many run)
# --paged without --num-pages or --cache-budget-gib: the pool holds this many sequences of
# --max-seq-len tokens, as many as the static default's rows hold, on top of the rows' own state
# (KIVI's R-token windows: for the embedded model 32 of them outweigh 8 static rows, so a budget
# of "8 static rows' bytes" could not even hold the rows and the default failed to start).
DEFAULT_SEQUENCES = 8
# The start-up line's yardstick: a chat sequence of the ShareGPT trace's mean length (161 prompt +
# 338 output tokens, as the vLLM paper reports it; benchmarks/traces.py).
CHAT_TOKENS = 500


def paged_by_default(device) -> bool:
    """Whether `kivi serve` uses the paged cache without --paged / --no-paged, by device. CPU: yes,
    as vLLM (a pool of pages holds more sequences than static rows). CUDA: not until a GPU run has
    passed the paged CUDA tests (issue 40); static rows stay its default until then."""
    import torch

    return torch.device(device).type == "cpu"


def resolve_paging_defaults(args, device) -> None:
    """--paged and --prefix-caching left unset take their defaults: paged by device
    (paged_by_default), prefix caching on with the paged cache (as vLLM's automatic prefix caching)."""
    if args.paged is None:
        args.paged = paged_by_default(device)
    if args.prefix_caching is None:
        args.prefix_caching = args.paged
# --prefix-caching: the default prefill chunk, rounded up to a multiple of the page size. Chunks
# of 64 cost 1.3x a one-shot prefill of 512 tokens (SmolLM2, CPU), chunks of 32 2.3-2.5x
# (docs/serve.md); smaller chunks share more of a prefix, bigger ones cost little more or less.
PREFIX_CHUNK = 64


def plan_pages(model, args, kivi_config, parser) -> tuple[int, int, int]:
    """--paged: (rows, pages, exact cache bytes). The pool gets --num-pages, else the pages that
    --cache-budget-gib holds after the rows' own state (lengths, KIVI's windows, the block table),
    else the rows' own state plus the pages of DEFAULT_SEQUENCES sequences of --max-seq-len tokens."""
    from kivi_models.generate import make_paged_cache, paged_bytes

    rows = args.max_batch or PAGED_ROWS
    with usage_errors(parser):
        per_page, fixed = paged_bytes(model, method=args.method, batch_size=rows, max_seq_len=args.max_seq_len,
                                      page_size=args.page_size, kivi_config=kivi_config)
        if args.num_pages is not None:
            pages = args.num_pages
        else:
            if args.cache_budget_gib is not None:
                if args.cache_budget_gib <= 0:
                    parser.error(f"--cache-budget-gib must be > 0, got {args.cache_budget_gib}")
                budget = args.cache_budget_gib * 2**30
            else:
                full = make_paged_cache(model, method=args.method, batch_size=1, max_seq_len=args.max_seq_len,
                                        num_pages=1, page_size=args.page_size, kivi_config=kivi_config,
                                        device="meta").pages_needed(args.max_seq_len)
                budget = fixed + DEFAULT_SEQUENCES * max(full, 1) * per_page
            pages = int((budget - fixed) // per_page)
            if pages <= 0:
                parser.error(f"the cache budget ({budget / 2**30:.4f} GiB) does not hold the state of {rows} rows "
                             f"({fixed / 2**30:.4f} GiB) and one page ({per_page} bytes); raise --cache-budget-gib or "
                             "lower --max-batch")
    return rows, pages, fixed + pages * per_page


def plan_slots(model, args, kivi_config, parser) -> tuple[int, int, int]:
    """(slots, bytes per slot, the slots an fp16 cache would get from the same bytes)."""
    from kivi_models.generate import cache_bytes_per_sequence, make_cache

    with usage_errors(parser):
        per_slot = cache_bytes_per_sequence(model, method=args.method, tokens=args.max_seq_len, kivi_config=kivi_config)
    fp16_per_slot = make_cache(model, method="fp", batch_size=1, max_seq_len=args.max_seq_len,
                               device="meta").fp16_nbytes()
    if args.cache_budget_gib is not None:
        if args.cache_budget_gib <= 0:
            parser.error(f"--cache-budget-gib must be > 0, got {args.cache_budget_gib}")
        budget = args.cache_budget_gib * 2**30
        slots = int(budget // per_slot)
        if slots == 0:
            parser.error(f"--cache-budget-gib {args.cache_budget_gib} does not hold one row of --max-seq-len "
                         f"{args.max_seq_len} tokens ({per_slot / 2**30:.3f} GiB); raise it or lower --max-seq-len")
    else:
        slots = args.max_batch or 8
        budget = slots * per_slot
    return slots, per_slot, int(budget // fp16_per_slot)


def fp16_paged_sequences(model, nbytes: int, tokens: int) -> int:
    """Sequences of `tokens` tokens an fp16 paged cache (vLLM's: 16-token pages, every token kept)
    holds in nbytes: the start-up line's comparison."""
    from kivi_ops.cache.paged_fp import DEFAULT_PAGE_SIZE

    from kivi_models.generate import make_cache

    padded = -(-tokens // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
    per_sequence = make_cache(model, method="fp", batch_size=1, max_seq_len=padded, device="meta").fp16_nbytes()
    return int(nbytes // per_sequence)


def check_paging_flags(args, parser) -> None:
    """The flag combinations refused before the model loads."""
    if args.paged:
        if args.num_pages is not None and args.cache_budget_gib is not None:
            parser.error("--num-pages and --cache-budget-gib exclude each other: both size the pool")
        for flag in ("prefix_chunk", "prefix_cache_size", "prefix_cache_gib"):
            if not args.prefix_caching and getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} applies only with --prefix-caching")
        return
    if args.prefix_caching:
        parser.error("--prefix-caching needs --paged (static rows hold no shareable pages)")
    if args.max_batch is not None and args.cache_budget_gib is not None:
        parser.error("argument --cache-budget-gib: not allowed with argument --max-batch (without --paged the "
                     "budget decides the rows)")
    for flag in ("num_pages", "page_size", "prefix_chunk", "prefix_cache_size", "prefix_cache_gib", "decode_buckets"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')} applies only with --paged")


def cmd_serve(args, parser) -> int:
    try:
        return serve(args, parser)
    except KeyboardInterrupt:  # Ctrl-C before the server's own handler is in place (loading the model)
        log("kivi serve: interrupted while starting")
        return 130


def serve(args, parser) -> int:
    import functools

    from kivi_models.generate import make_paged_cache
    from kivi_models.parallel import is_main_process, world_size
    from kivi_serve.engine import Engine
    from kivi_serve.paged_options import PagedServing, check_prefix_caching, decode_buckets
    from kivi_serve.runner import Runner

    kivi_config = kivi_config_from(args, parser)
    device, dtype = device_and_dtype(args, parser)
    check_weight_quant_modes([args.weight_quant], device, parser)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    api_key, allowed_hosts = access_settings(args, parser)
    resolve_paging_defaults(args, device)
    check_paging_flags(args, parser)
    limits = ConnectionLimits(check_connection_limits(args.max_connections, parser), args.timeout_keep_alive,
                              args.read_timeout)
    make_runner, channel = Runner, None
    if world_size() > 1:  # tensor parallelism (serve/tp.py): rank 0 serves, the others replay its plans
        from kivi_serve import tp as serve_tp

        channel = serve_tp.DistChannel(serve_tp.init_groups(device, args.tp_timeout))
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    context = model.config.max_position_embeddings
    if args.max_seq_len > context:
        parser.error(f"--max-seq-len {args.max_seq_len} exceeds the model's context of {context} tokens")
    from kivi_models.attention import patch_model
    from kivi_models.weight_quant import apply_weight_quant

    with usage_errors(parser):
        apply_weight_quant(model, args.weight_quant)
    patch_model(model)
    if not args.paged:
        slots, per_slot, fp16_slots = plan_slots(model, args, kivi_config, parser)
        nbytes, paging = slots * per_slot, None
        check_memory(nbytes, device, what=f"the cache ({slots} rows x {args.max_seq_len} tokens)")
    else:
        slots, pages, nbytes = plan_pages(model, args, kivi_config, parser)
        paging = PagedServing(pages, args.page_size, decode_buckets=args.decode_buckets)
        with usage_errors(parser):
            decode_buckets(slots, args.decode_buckets)
        if args.prefix_caching:  # the default chunk needs the page size, known once the cache kind is
            page = args.page_size or make_paged_cache(model, method=args.method, batch_size=1, max_seq_len=1,
                                                      num_pages=1, kivi_config=kivi_config, device="meta").page_size
            chunk = args.prefix_chunk or page * -(-PREFIX_CHUNK // page)
            tail_bytes = None if args.prefix_cache_gib is None else max(1, int(args.prefix_cache_gib * 2**30))
            paging = PagedServing(pages, args.page_size, chunk, args.prefix_cache_size, args.decode_buckets,
                                  tail_bytes)
            with usage_errors(parser):  # before the ranks of torchrun start waiting on each other
                check_prefix_caching(paging, page)
        check_memory(nbytes, device, what=f"the paged cache ({pages} pages, {slots} rows)")
    name = args.served_model_name or (DEFAULT_NAME if args.model == DEFAULT_MODEL
                                      else args.model.rstrip("/").split("/")[-1])
    with usage_errors(parser):
        config = ServeConfig(method=args.method, kivi_config=kivi_config, slots=slots, max_seq_len=args.max_seq_len,
                             paging=paging, compile=args.compile, max_waiting=args.max_waiting,
                             request_timeout=args.request_timeout, stall_timeout=args.stall_timeout,
                             served_model_name=name, max_request_bytes=args.max_request_bytes, api_key=api_key,
                             allowed_hosts=allowed_hosts, docs=args.docs)
    if channel is not None:
        if not is_main_process():
            with usage_errors(parser):
                runner = Runner(model, **config.runner_options())
            return serve_tp.run_worker(runner, channel)
        make_runner = functools.partial(serve_tp.LeaderRunner, channel=channel, timeout_s=args.tp_timeout)
    with usage_errors(parser):
        engine = Engine(model, tokenizer, config, make_runner=make_runner)
    try:  # from here the engine thread runs (its warm-up first): however serving ends, it stops
        share = f" per rank ({world_size()} ranks, each its own KV heads)" if channel is not None else ""
        if paging is None:
            log(f"{slots} slots x {args.max_seq_len} tokens, {nbytes / 2**20:.1f} MiB of {args.method} cache{share} "
                f"(an fp16 cache would hold {fp16_slots} slots in the same bytes)")
        else:
            chat = min(CHAT_TOKENS, args.max_seq_len)
            held = min(slots, paging.num_pages // max(engine.cache.pages_needed(chat), 1))
            log(f"paged: {slots} rows, a pool of {paging.num_pages} pages of {engine.cache.page_size} tokens, "
                f"{nbytes / 2**20:.1f} MiB of {args.method} cache{share}: {held} sequences of {chat} tokens (chat length) "
                f"at once, where an fp16 paged cache would hold {fp16_paged_sequences(model, nbytes, chat)} in the same "
                f"bytes; a request holds at most {args.max_seq_len} tokens"
                + (f"; prefix caching in chunks of {paging.prefix_chunk} tokens, {engine.placement.max_prefixes} prefixes "
                   f"kept at most, their tails in {engine.placement.max_prefix_bytes / 2**20:.1f} MiB of host memory at "
                   f"most" if paging.prefix_chunk else "")
                + f"; decode steps over {', '.join(map(str, engine.placement.buckets))} rows")
        log(f"serving {name!r} at http://{args.host}:{args.port}/v1 (OpenAI API; /health, /metrics)")
        server = Server(uvicorn_config(build_app(engine), host=args.host, port=args.port, limits=limits), engine,
                        shutdown_timeout=args.shutdown_timeout)
        server.run()
    finally:
        stop_engine(engine)
    return 0


# Seconds the server waits, once its connections are closed, for the engine thread to finish the
# step it is in; during warm-up (a compile may take minutes, and no request ran) it does not wait.
ENGINE_STOP_WAIT_S = 10.0


def stop_engine(engine) -> None:
    """Stop the engine thread, or, if it is still in a compile or a step that does not end, leave
    the process at once (os._exit, with the exit status the process was heading for): letting the
    interpreter finalize with that thread inside torch's C++ aborts it (`terminate called without
    an active exception`, SIGABRT). Nothing is half-written: what the engine holds is in memory,
    and Inductor writes its cache files whole (renamed into place)."""
    import logging
    import sys

    exc = sys.exc_info()[1]
    try:
        if engine.close(timeout=ENGINE_STOP_WAIT_S if engine.ready.is_set() else 0.5):
            return
    except KeyboardInterrupt:  # Ctrl-C while waiting: uvicorn's handlers are gone once it has stopped
        exc = exc or KeyboardInterrupt()
    status = (0 if exc is None else exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int)
              else 130 if isinstance(exc, KeyboardInterrupt) else 1)
    if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        import traceback  # what ended serving would otherwise never be printed: os._exit skips main's handler

        traceback.print_exception(exc)
    log("the engine thread is still running (a compile or a hung step): exiting without waiting for it")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


