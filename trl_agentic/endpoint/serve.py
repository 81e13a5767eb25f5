"""`trl-agentic serve`: a model behind the OpenAI-compatible, token-recording endpoint, as its own process.

```bash
trl-agentic serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000 --temperature 1.0 --max-tokens 512
trl-agentic serve --model tiny:qwen2_5            # a tiny random model built locally, for trying things out
```

With `--store PATH`, users get keys of their own (`POST /admin/users`): a plain client points at `/v1` with its key
and no per-episode handshake, the endpoint groups its calls into episodes, stores them when they end, and takes
feedback (`POST /v1/feedback`) and the admin's rewards (`POST /admin/rewards`); see `users.py`. With
`--published-versions` as well, it rolls out the versions a trainer in another process (or on another machine)
publishes in that store (`version_sync.py`, docs/online.md).

Agents never see the admin token: whoever runs them opens an episode with it (`POST /admin/episodes`), hands the
agent the returned `base_url` and `key` (any OpenAI client works), and closes the episode to get every recorded
token back (`POST /admin/episodes/{id}/close` returns the Episode JSON).

State is bounded: at most `--max-open-episodes` episodes at once (429 beyond), and an episode without a call for
`--episode-idle-timeout` seconds is closed with status `cancelled`. The admin token is printed only when `serve`
generated it; episode ids (the secret of the `/episodes/{id}/v1` route) are redacted from the access log.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from . import SERVED_MODEL_NAME
from .launch import DEFAULT_BATCH_WAIT_MS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_TOKENS


ADMIN_TOKEN_ENV = "TRL_AGENTIC_ADMIN_TOKEN"
# A standalone endpoint serves agents that may never close their episodes: keep its state bounded by default.
DEFAULT_MAX_OPEN_EPISODES = 4096
DEFAULT_EPISODE_IDLE_TIMEOUT = 1800.0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-agentic serve",
        description="Serve a model behind the OpenAI-compatible endpoint that records every sampled token.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="Hub id or local path, or 'tiny:<family>[:<hidden>x<layers>]' for a tiny random model.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind (loopback by default).")
    parser.add_argument("--port", type=int, default=8000, help="Port to bind.")
    parser.add_argument(
        "--admin-token",
        default=None,
        help=f"Bearer token of the /admin routes (default: ${ADMIN_TOKEN_ENV}, else a random one).",
    )
    parser.add_argument(
        "--served-model-name",
        default=SERVED_MODEL_NAME,
        help="Value of `model` the endpoint answers to (others get 404).",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="Weights dtype ('auto': bfloat16 on GPU, float32 on CPU).",
    )
    parser.add_argument("--device", default=None, help="Torch device (default: cuda if available, else cpu).")
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="Most concurrent calls sampled together."
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=DEFAULT_BATCH_WAIT_MS,
        help="How long the first call of a batch waits for others to join.",
    )
    parser.add_argument(
        "--max-context-length",
        type=int,
        default=None,
        help="Prompt + completion tokens accepted (default: the model's max_position_embeddings).",
    )
    parser.add_argument("--temperature", type=float, default=None, help="Imposed temperature (default: the request's).")
    parser.add_argument("--top-p", type=float, default=None, help="Imposed top-p (default: the request's).")
    parser.add_argument("--top-k", type=int, default=None, help="Imposed top-k (default: none).")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="Cap on tokens per call (a request may ask for fewer)."
    )
    parser.add_argument(
        "--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max_tokens of a request that sets none."
    )
    parser.add_argument("--max-turns", type=int, default=None, help="Default cap on model calls per episode.")
    parser.add_argument(
        "--max-episode-tokens", type=int, default=None, help="Default cap on sampled tokens per episode."
    )
    parser.add_argument(
        "--max-open-episodes",
        type=int,
        default=DEFAULT_MAX_OPEN_EPISODES,
        help="Most episodes open at once; opening more is answered 429 (0: no cap).",
    )
    parser.add_argument(
        "--episode-idle-timeout",
        type=float,
        default=DEFAULT_EPISODE_IDLE_TIMEOUT,
        help="Seconds without a call after which an episode is closed with status 'cancelled' (0: never).",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON object of extra chat-template variables, e.g. '{\"enable_thinking\": false}'.",
    )
    parser.add_argument(
        "--store",
        default=None,
        help="SQLite file (or postgresql:// URL) of users, closed episodes and rewards: enables user keys (POST /admin/users), their "
        "feedback and the admin's rewards; survives restarts (docs/serving.md#user-keys).",
    )
    parser.add_argument(
        "--user-episode-idle-timeout",
        type=float,
        default=300.0,
        help="With --store: seconds without a call after which a user key's episode ends and is stored.",
    )
    parser.add_argument(
        "--feedback-per-minute", type=int, default=60, help="With --store: most feedback calls per user a minute."
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="With --store: train on the store's rewarded episodes in this process and roll each step out "
        "gradually (online RL; `trl-agentic serve --train --help` lists its options, docs/online.md).",
    )
    parser.add_argument(
        "--published-versions",
        action="store_true",
        help="With --store: load the versions a trainer in another process publishes in the store and roll them "
        "out gradually (online training on two machines; docs/online.md).",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level.")
    add_rollout_arguments(parser)
    return parser


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """The gradual-rollout rule's options (`RolloutPolicy`), for `--train` and `--published-versions`."""
    group = parser.add_argument_group("gradual rollout (--train, --published-versions)")
    group.add_argument("--candidate-share", type=float, default=0.1, help="Share of new episodes a candidate serves.")
    group.add_argument("--min-episodes", type=int, default=32, help="Rewarded episodes before a candidate's verdict.")
    group.add_argument("--margin", type=float, default=0.05, help="How far below the incumbent a candidate may be.")
    group.add_argument(
        "--confidence", type=float, default=0.95, help="How sure a verdict must be (0.5: compare the means alone)."
    )
    group.add_argument(
        "--max-episodes", type=int, default=None, help="Rewarded episodes before an unproven candidate is rolled back."
    )
    group.add_argument(
        "--length-guard",
        type=float,
        default=None,
        help="Roll back a candidate whose sampled tokens per episode differ from the incumbent's by more than this "
        "factor either way (0.5: above 1.5x or below 1/1.5x), whatever its reward (default: off).",
    )
    group.add_argument(
        "--malformed-guard",
        type=float,
        default=None,
        help="Roll back a candidate whose malformed tool calls per model call exceed the incumbent's by more than "
        "this (e.g. 0.15), at --confidence, whatever its reward (default: off).",
    )
    group.add_argument("--version-poll", type=float, default=1.0, help="Seconds between two looks for new versions.")


def rollout_policy(args: argparse.Namespace):
    """The [`RolloutPolicy`] of the "gradual rollout" options."""
    from .versions import RolloutPolicy

    return RolloutPolicy(
        args.candidate_share,
        args.min_episodes,
        args.margin,
        args.confidence,
        args.max_episodes,
        args.length_guard,
        args.malformed_guard,
    )


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.train:
        make_parser().error("--train runs through the CLI: `trl-agentic serve --train ...` (scripts/serve_train.py).")
    if args.published_versions and args.store is None:
        make_parser().error("--published-versions needs --store: the trainer publishes its versions there.")

    import uvicorn

    from ..store import open_store
    from .launch import build_engine
    from .server import uvicorn_log_config

    model, tokenizer, device, dtype = load_policy(args)
    model.eval()
    engine = build_engine(
        model,
        tokenizer,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_context_length=args.max_context_length,
    )
    admin_token, shown_token, origin = resolve_admin_token(args)
    store = None if args.store is None else open_store(args.store)
    if args.published_versions:
        return serve_published_versions(
            args, engine, tokenizer, store, admin_token, (device, dtype, shown_token, origin)
        )
    app = build_app(args, engine, tokenizer, admin_token, store)
    print_banner(args, app, device, dtype, shown_token, origin)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=30,
        log_config=uvicorn_log_config(),
    )
    return 0


def serve_published_versions(args, engine, tokenizer, store, admin_token: str, banner: tuple) -> int:
    """Serve with gradual rollout of the versions a trainer elsewhere publishes in `store`, until interrupted."""
    import time

    from transformers import AutoModelForCausalLM

    from .launch import build_engine
    from .server import EndpointServer
    from .version_sync import PublishedVersions
    from .versions import VersionManager

    device, dtype, shown_token, origin = banner
    policy = rollout_policy(args)
    versions = VersionManager(engine, policy)

    def load(path: str, version: int):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return build_engine(
            model,
            tokenizer,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            max_context_length=args.max_context_length,
        )

    app = build_app(args, engine, tokenizer, admin_token, store, versions)
    server = EndpointServer(app, host=args.host, port=args.port, log_level=args.log_level).start()
    sync = PublishedVersions(versions, store, load, interval=args.version_poll).start(server.call)
    print_banner(args, app, device, dtype, shown_token, origin)
    print(f"rolling out the versions published in {args.store} (GET /admin/versions)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        sync.stop()
        server.stop()
    return 0


def load_policy(args):
    """The served model and its tokenizer, on `--device` in `--dtype`: `(model, tokenizer, device, dtype)`."""
    import torch

    from ..tiny_models import load_model_and_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype)
    model.to(device=device, dtype=dtype)
    return model, tokenizer, device, dtype


def resolve_admin_token(args) -> tuple[str, str, str]:
    """`(token, how the banner shows it, where it came from)`. The token is printed only when it is ours: one the
    user chose may live in shell history, logs or a job's output, and stays where they put it."""
    if args.admin_token:
        return args.admin_token, "<your --admin-token>", "as given (--admin-token)"
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV], f"${ADMIN_TOKEN_ENV}", f"as given (${ADMIN_TOKEN_ENV})"
    token = f"sk-admin-{secrets.token_urlsafe(32)}"
    return token, token, token


def build_app(args, engine, tokenizer, admin_token: str, store=None, versions=None):
    """The endpoint app `serve`'s arguments describe, over `engine`."""
    from .launch import create_endpoint_app

    app = create_endpoint_app(
        engine,
        tokenizer,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens,
        max_turns=args.max_turns,
        max_episode_tokens=args.max_episode_tokens,
        chat_template_kwargs=args.chat_template_kwargs,
        served_model_name=args.served_model_name,
        admin_token=admin_token,
        max_open_episodes=args.max_open_episodes or None,
        episode_idle_timeout=args.episode_idle_timeout or None,
        store=store,
        versions=versions,
        user_episode_idle_timeout=args.user_episode_idle_timeout,
        feedback_per_minute=args.feedback_per_minute,
    )
    if not app.state.renderer.can_parse_tools:
        print(
            f"warning: no tool-call parser is known for the chat template of {args.model!r}; tool calls are "
            "returned as text content.",
            file=sys.stderr,
        )
    return app


def print_banner(args, app, device, dtype, shown_token: str, origin: str) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    print(
        f"trl-agentic endpoint: serving {args.model!r} as {args.served_model_name!r} on {url} ({device}, {dtype})\n"
        f"admin token: {origin}\n"
        f"open an episode:\n"
        f"  curl -s -X POST {url}/admin/episodes -H 'Authorization: Bearer {shown_token}' "
        f"-H 'Content-Type: application/json' -d '{{}}'\n"
        f"then point any OpenAI client at the returned base_url with the returned key, and close the episode to get "
        f"its tokens:\n"
        f"  curl -s -X POST {url}/admin/episodes/<id>/close -H 'Authorization: Bearer {shown_token}'",
        flush=True,
    )
    if args.store is not None:
        print(
            f"user keys (store {args.store}): add a user, then point any client at {url}/v1 with its key:\n"
            f"  curl -s -X POST {url}/admin/users -H 'Authorization: Bearer {shown_token}' "
            f"-H 'Content-Type: application/json' -d '{{\"name\": \"alice\"}}'\n"
            f"  curl -s {url}/v1/chat/completions -H 'Authorization: Bearer <user key>' "
            f"-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{args.served_model_name}", "messages": [{{"role": "user", "content": "hi"}}]}}\'',
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
