"""``actorlm serve | actor | plugins | messages``.

Every config field is a flag (``--page-size``, ``--eviction-policy``, ...),
generated from the config tree so the CLI and the config never drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import msgspec

from .actors.runtime.keys import KEY_ROLES, InsecureBindError, MissingKeyError, create_keys
from .actors.runtime.process import PluginLoadError
from .config import EngineConfig
from .extensions.plugins import PlatformError, PluginAPIError
from .extensions.registry import UnknownNameError
from .extensions.settings import parse_plugin_config
from .flag_help import FLAG_HELP, GROUP_TITLES
from .launch import _SECTIONS, ConfigError, config_from_options, load_deployment, resolve_config

__all__ = ["USER_ERRORS", "build_parser", "main"]

# What a user's mistake raises (bugs raise anything else, and keep their traceback).
USER_ERRORS = (
    ConfigError,
    PluginAPIError,
    PluginLoadError,
    UnknownNameError,
    PlatformError,
    MissingKeyError,
    InsecureBindError,
    FileNotFoundError,
    PermissionError,
)

# Flag spellings users of SGLang/vLLM expect, beside the generated ones.
_ALIASES = {
    "path": ["--model", "--model-path"],
    "policy": ["--schedule-policy"],
    "max_running_requests": ["--max-num-seqs"],
    "enable_prefix_cache": [],
    "grammar_compile_timeout_s": ["--grammar-compile-timeout", "--grammar-compile-timeout-s"],
    "drain_timeout_s": ["--drain-timeout-s", "--shutdown-timeout"],
}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    seen: set[str] = set()
    for section, cls in _SECTIONS.items():
        if section == "deploy":  # addresses come from a deployment file
            fields = [f for f in msgspec.structs.fields(cls) if f.name != "addresses"]
        else:
            fields = list(msgspec.structs.fields(cls))
        group = parser.add_argument_group(GROUP_TITLES[section])
        for f in fields:
            if f.name in seen:
                continue
            seen.add(f.name)
            flags = _ALIASES.get(f.name, [f"--{f.name.replace('_', '-')}"])
            default = f.default if f.default not in ("", 0, 0.0) else "unset"
            text = f"{FLAG_HELP[f.name]} (default: {default})"
            if f.name == "enable_prefix_cache":
                group.add_argument(
                    "--disable-prefix-cache",
                    dest=f.name,
                    action="store_false",
                    default=None,
                    help="do not share KV pages between prompts (default: shared)",
                )
                continue
            if isinstance(f.default, bool):
                group.add_argument(
                    *flags,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=text,
                )
            elif isinstance(f.default, (int, float, str)):
                group.add_argument(
                    *flags,
                    dest=f.name,
                    type=type(f.default),
                    default=None,
                    metavar=f.name.upper(),
                    help=text,
                )
            elif f.default_factory is list:  # a list of strings: --lora-paths a=/x b=/y
                group.add_argument(
                    *flags,
                    dest=f.name,
                    nargs="+",
                    default=None,
                    metavar=f.name.upper(),
                    help=text,
                )
    extra = parser.add_argument_group("plugins and logging")
    extra.add_argument(
        "--plugin-config",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="a setting for plugin NAME, handed to its register() (repeatable)",
    )
    extra.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="log level of every process (default: info)",
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for cls in _SECTIONS.values() for f in msgspec.structs.fields(cls)} | {
        "log_level"
    }
    out = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "plugin_config", None):
        try:
            out["plugins"] = parse_plugin_config(args.plugin_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actorlm", description="An LLM serving engine built from actors."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start every actor and the HTTP gateway")
    _add_config_flags(serve)
    serve.add_argument(
        "--deploy", help="TOML deployment file: connect to actors started with `actorlm actor`"
    )
    actor = sub.add_parser("actor", help="run one actor alone (disaggregated deployment)")
    actor.add_argument(
        "role",
        help="tokenizer | scheduler | cache_manager | worker | lora_loader | gateway, "
        "or module:Class",
    )
    actor.add_argument("--deploy", help="TOML deployment file naming every actor's address")
    actor.add_argument("--bind", help="address this actor binds (unix://, ipc:// or tcp://)")
    actor.add_argument("--address", help="address peers use to reach it (default: --bind)")
    actor.add_argument(
        "--peer", action="append", default=[], metavar="ROLE=ADDR", help="a peer's address"
    )
    _add_config_flags(actor)
    keys = sub.add_parser("keys", help="create CurveZMQ key pairs for tcp deployments")
    keys.add_argument("dir", help="folder for ROLE.key (public) and ROLE.key_secret files")
    keys.add_argument(
        "--roles",
        default=",".join(KEY_ROLES),
        help=f"comma-separated roles (default: {','.join(KEY_ROLES)})",
    )
    keys.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="also the members of data-parallel replicas 1..N-1 (scheduler.1, worker.1, ...)",
    )
    keys.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        help="also the members of this many prefill replicas (numbered after --dp-size's)",
    )
    plugins = sub.add_parser(
        "plugins", help="list plugins, the platform, registries, hooks and interceptors"
    )
    plugins.add_argument(
        "--hooks", action="store_true", help="list the declared hook targets, with signatures"
    )
    plugins.add_argument(
        "--plugin-config",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="as for serve",
    )
    sub.add_parser("messages", help="print the schema of every message")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``actorlm`` command. A user's mistake (a bad flag value, a missing file, an
    unknown name) is one line on stderr and exit status 2, never a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except USER_ERRORS as exc:
        print(f"actorlm: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "actor":
        return _actor(args)
    if args.command == "keys":
        from .actors.replicas import replica_members

        roles = [r for r in args.roles.split(",") if r]
        count = args.dp_size + args.prefill_replicas
        roles += [r for i in range(1, count) for r in replica_members(i)]
        made = create_keys(args.dir, tuple(roles))
        print(f"actorlm: {len(made)} key pair(s) in {args.dir}")
        for path in made:
            print(f"  {path.with_suffix('.key')}  {path}")
        return 0
    if args.command == "plugins":
        from .report import print_hook_surface, print_plugins

        if args.hooks:
            return print_hook_surface(sys.stdout)
        return print_plugins(sys.stdout, _options(args).get("plugins", {}))
    from .schema import print_schemas

    print_schemas(sys.stdout)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .actors.runtime.process import prepare_process
    from .serve import serve

    deployment = load_deployment(args.deploy) if args.deploy else None
    base = deployment.config if deployment is not None else EngineConfig()
    config = config_from_options(base, **_options(args))
    prepare_process(config, "gateway")
    return serve(resolve_config(config), deployment)


def _actor(args: argparse.Namespace) -> int:
    from .actors.runtime.process import event_loop_runner, prepare_process
    from .actors.runtime.supervisor import run_actor

    if args.deploy:
        deployment = load_deployment(args.deploy)
        config = config_from_options(deployment.config, **_options(args))
        if args.role not in deployment.addresses:
            raise ConfigError(f"{args.deploy} has no [actors.{args.role}]")
        book = dict(deployment.addresses)
        bind = args.bind or deployment.binds[args.role]
        address = deployment.addresses[args.role]
    else:
        if not args.bind:
            raise ConfigError("give --deploy FILE, or --bind ADDR with --peer ROLE=ADDR")
        config = config_from_options(EngineConfig(), **_options(args))
        book = dict(p.split("=", 1) for p in args.peer)
        bind, address = args.bind, args.address or args.bind
    prepare_process(config, args.role)
    config = resolve_config(config)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop_runner()(run_actor(args.role, config, address, book, bind=bind))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
