"""The `kvblend` command line: the command root, the only place that imports across the
storage -> blend -> eval layers.

Subcommands: ask, ingest, chat, demo, eval, store, plan, serve, serve-vllm, delete, bench {load, ttft, resume, serve}.
Conventions, the same in every subcommand:
- `--config FILE` (default: $KVBLEND_CONFIG, else the packaged default; blend.config.load_config);
- `--json`: stdout's last line is one JSON object (human-readable lines go to stderr);
- bad input: one line `kvblend ...: error: ...` on stderr naming the fault and the fix,
  exit code 2, nothing written; `-v` adds the traceback and transformers' progress bars;
- building the parser imports no torch, transformers, redis or pydantic (`kvblend --help` is fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

# Errors that are the user's to fix: one line and exit 2. Classes of modules that are not
# imported yet cannot have been raised, so they are looked up in sys.modules, not imported.
# OSError: also a file system that refuses a write (full, read-only): one line naming the file, not a traceback
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)
_LAZY_USER_ERRORS = (("storage.tier", "StoreUnavailable"), ("blend.session.manager", "SessionBusy"),
                     ("blend.model.native", "NativeBuildError"))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole `kvblend` parser; imports only the light command modules."""
    from blend.cli import bench, demo, eval, plan, requests, serve, serve_vllm, store

    parser = Parser(prog="kvblend", description="Reuse precomputed document KV caches for fast RAG.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level; show tracebacks and model-loading progress bars")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    requests.register(subparsers)
    demo.register(subparsers)
    eval.register(subparsers)
    store.register(subparsers)
    plan.register(subparsers)
    bench.register(subparsers)
    serve.register(subparsers)
    serve_vllm.register(subparsers)
    _verbose_everywhere(parser)
    return parser


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept `-v` after any (sub)command too (`kvblend store stats -v`). Its default is
    SUPPRESS, so a subcommand without it never overrides a `-v` given before it."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers here only
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="as `kvblend -v`: logs, tracebacks, model-loading progress bars")
                _verbose_everywhere(sub)


def _user_errors() -> tuple[type[BaseException], ...]:
    lazy = tuple(getattr(sys.modules[m], name) for m, name in _LAZY_USER_ERRORS if m in sys.modules)
    return _USER_ERRORS + lazy


def _progress_bars(show: bool) -> None:
    """Show or hide transformers / huggingface_hub / datasets progress bars (weight loading,
    dataset preparation) in this process."""
    for variable in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):  # read at import
        if show:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = "1"
    if "datasets" in sys.modules:
        import datasets

        datasets.enable_progress_bars() if show else datasets.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar() if show else hf_logging.disable_progress_bar()


def _interrupted(_signum: int, _frame: object) -> None:
    """The first ^C: KeyboardInterrupt, so the command winds down (queued writes flushed,
    result files left valid); from then on a second ^C ends the process at once."""
    signal.signal(signal.SIGINT, _interrupted_again)
    raise KeyboardInterrupt


def _interrupted_again(_signum: int, _frame: object) -> None:
    os.write(2, b"kvblend: interrupted again; exiting now\n")
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    """Run one `kvblend` command; returns the exit code (argparse usage errors and --help
    raise SystemExit, code 2 and 0; ^C: 130, a second ^C exits at once, also 130)."""
    previous = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous = signal.signal(signal.SIGINT, _interrupted)
    interrupted = False
    try:
        if sys.stdout is None:  # started with stdout closed (`>&-`): what it prints goes nowhere
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        code = _run(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # stdout closed early (`kvblend store ls | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 141
    except KeyboardInterrupt:
        interrupted = True
        print("kvblend: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None and not interrupted:  # interrupted: the process winds down, ^C stays final
            signal.signal(signal.SIGINT, previous)


# the hub and datasets libraries' own log lines (retries, a file they cannot parse) that the
# one-line error after them already says; shown with -v
_LIBRARY_LOGS = (("huggingface_hub", "HF_HUB_VERBOSITY", logging.ERROR),
                 ("datasets", "DATASETS_VERBOSITY", logging.CRITICAL))


def _library_logs(show: bool) -> None:
    """Quiet (or, with -v, leave alone) the libraries' own loggers: by environment variable
    for a later import, by level where one is imported already."""
    if show:
        return
    for name, variable, level in _LIBRARY_LOGS:
        os.environ.setdefault(variable, logging.getLevelName(level).lower())
        if name in sys.modules:
            logging.getLogger(name).setLevel(level)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _progress_bars(show=args.verbose)
    _library_logs(show=args.verbose)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as err:
        from blend.cli.common import EVAL_EXTRA, missing_extra_message

        package = (err.name or "").split(".")[0]
        if package not in EVAL_EXTRA:
            raise
        print(f"kvblend: error: {missing_extra_message(package)}", file=sys.stderr)
        return 2
    except Exception as err:
        if not isinstance(err, _user_errors()) or isinstance(err, BrokenPipeError):
            raise
        if args.verbose:
            traceback.print_exc()
        for line in str(err).splitlines() or [type(err).__name__]:  # one line per problem
            print(f"kvblend: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
