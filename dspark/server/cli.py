"""`dspark serve` (also `python -m dspark.serve`): the OpenAI-compatible server with SGLang's flag
names. Every flag is checked before the model loads, so a bad combination fails in a second."""
from __future__ import annotations

import argparse
import logging
import time

from dspark.cli_args import add_model_args, add_speculative_args, model_options, speculative_options

log = logging.getLogger("dspark.server")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (SGLang-style flags)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                   "/metrics. With no flags: the embedded model and its shipped DSpark drafter.")
    add_serve_args(p)
    p.set_defaults(func=serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the model's directory name)")
    g.add_argument("--max-running-requests", type=int, default=32, help="requests in the running batch")
    g.add_argument("--max-queued-requests", type=int, default=128,
                   help="admitted requests waiting beyond the running batch; more are answered 429")
    g.add_argument("--context-length", type=int, default=None,
                   help="max prompt + completion tokens (default: the model's)")
    g.add_argument("--chunked-prefill-size", type=int, default=512, help="prefill tokens per engine step")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens (default: 1 GiB)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies are answered 413")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send its request headers, and again its body (408 / closed)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_speculative_args(p)
    p.set_defaults(speculative_algorithm=None)  # None: DSPARK on the embedded model when its drafter ships


def serve(args: argparse.Namespace) -> int:
    """Validate flags, bind the port, load and warm up the model, then serve until interrupted."""
    from dspark.server.compute import ComputeThread
    from dspark.server.config import ServerConfig
    from dspark.server.launch import bind_socket, run_server

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_queued_requests=args.max_queued_requests,
                          max_request_bytes=args.max_request_bytes, read_timeout_s=args.read_timeout)
    engine = engine_config_from_flags(args)
    sock = bind_socket(config.host, config.port)
    spec = engine.speculative
    log.info("flags checked: model %s, speculative %s, verify %s, %d running + %d queued requests, %s:%d",
             engine.target.model or "embedded", spec.algorithm, spec.verify_mode, engine.scheduler.max_num_seqs,
             config.max_queued_requests, config.host, sock.getsockname()[1])
    compute = ComputeThread()  # loads the model, warms it up, then runs the engine loop: one OpenMP team
    llm = compute.call(load_llm, engine)
    compute.call(warm_up, llm)
    run_server(llm, config, sock, log_level=args.log_level, compute=compute)
    return 0


SERVER_FLAGS = {"max_num_seqs": "--max-running-requests", "max_num_batched_tokens": "--chunked-prefill-size",
                "max_model_len": "--context-length", "max_total_tokens": "--max-total-tokens"}


def engine_config_from_flags(args: argparse.Namespace):
    """The EngineConfig of the flags, its files checked: ValueError / FileNotFoundError for bad ones, fast."""
    from dspark.cli_args import engine_config

    args.speculative_algorithm = _default_algorithm(args)
    options = {**model_options(args), **speculative_options(args, sps_profile="quick"),  # /health in seconds
               "max_num_seqs": args.max_running_requests, "max_num_batched_tokens": args.chunked_prefill_size,
               "max_model_len": args.context_length, "max_total_tokens": args.max_total_tokens}
    return engine_config(options, SERVER_FLAGS, check_files=True)


def _default_algorithm(args: argparse.Namespace) -> str:
    if args.speculative_algorithm is not None:
        return args.speculative_algorithm
    if args.draft_model is not None:
        return "DSPARK"
    if args.model is None:
        from dspark.drafters.registry import shipped_drafter

        try:
            shipped_drafter("DSPARK")
            return "DSPARK"
        except FileNotFoundError as e:
            log.warning("%s; serving with plain decoding (--speculative-algorithm NONE)", e)
    return "NONE"


def load_llm(config):
    """Load the target (and drafter, planner, SPS profile) of an EngineConfig, one log line per stage."""
    from dspark import LLM

    algo, t = config.speculative.algorithm, config.target
    log.info("loading model %s (%s on %s)%s", t.model or "embedded", t.dtype, t.device,
             "" if algo == "NONE" else f" with {algo} drafting; the SPS table is profiled once when none is given")
    t = time.perf_counter()
    llm = LLM(config=config, profile_progress=False)
    eng = llm.engine
    log.info("model loaded in %.1f s: context %d tokens, KV cache %d tokens, %s proposer (%d drafts), planner %s",
             time.perf_counter() - t, eng.max_model_len, eng.cache.num_blocks * eng.cache.block_size,
             type(eng.proposer).__name__, eng.proposer.max_drafts,
             type(eng.planner).__name__)
    return llm


def warm_up(llm) -> None:
    """One short request through prefill and a verify round, so the first client is not the one who waits."""
    from dspark import SamplingParams

    t = time.perf_counter()
    llm.generate([list(range(1, 9))], SamplingParams(max_tokens=4, ignore_eos=True))
    log.info("warm-up done in %.2f s", time.perf_counter() - t)
