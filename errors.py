"""The one place where a user's mistake becomes one line: the checks every config dataclass
runs (model/, data/, training/ and generate.py's), and the exit that prints the message.

Plain Python on purpose: model/ and data/ may not import each other, and both check values
the same way, so the checks live beside them rather than in either.
"""

import atexit
import contextlib
import dataclasses
import math
import os
import signal
import sys
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn, TypeVar, Union, get_args, get_origin

T = TypeVar("T")

# What a user's config or input causes; the message names the value and the fix.
USER_ERRORS = (ValueError, FileNotFoundError)


def exit_on_user_error(
    action: Callable[[], T], errors: tuple[type[BaseException], ...] = USER_ERRORS
) -> T:
    """Run action; an error of `errors` (one the user can fix) is printed on one line and exits
    with status 1.

    HYDRA_FULL_ERROR=1 shows the traceback instead, as it does for Hydra's own errors.
    """
    try:
        return action()
    except errors as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(1)


def override_key(override: str) -> str:
    """The key a command-line override sets: `a.b` of `a.b=1`, `+a.b=1`, `++a.b=1`, `~a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def exit_on_broken_pipe() -> NoReturn:
    """End a command whose stdout reader stopped early (`| head`): it has what it wanted, so no
    traceback, and the status of a process that SIGPIPE ended, as other tools of a pipeline."""
    # Python would fail again flushing stdout at exit: point it at nothing first.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


def end_as_interrupted(*, newline: bool) -> NoReturn:
    """End the command as Ctrl-C ends a program that lets it through: KeyboardInterrupt up to the
    interpreter, and once its finally blocks, its threads and its exit callbacks have run, the
    process ends by SIGINT, here without a traceback; with `newline`, a line break, so that the
    shell's prompt comes on a line of its own after the ^C. The shell's $? reads 130 either way,
    but a shell running the command in a loop goes on to the next one after a command that exited
    by itself with 130: it takes the Ctrl-C to have been handled. Python ends by SIGINT after an
    uncaught KeyboardInterrupt only where no exit callback runs code from a string (eval, exec):
    one that does (torch._dynamo's report of compile times, through a namedtuple) erases its
    record of the interrupt, and the process exits with status 1."""
    print_traceback = sys.excepthook

    def quietly(kind: type[BaseException], error: BaseException, traceback: object) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            print_traceback(kind, error, traceback)
            return
        if newline:
            print(file=sys.stderr)
        atexit.register(_end_by_sigint_after_the_exit_callbacks)  # the last one, so run first

    sys.excepthook = quietly
    raise KeyboardInterrupt


def _end_by_sigint_after_the_exit_callbacks() -> None:
    """The first exit callback to run: runs the others, in their order (atexit's own runner,
    underscored, in every Python 3), then ends the process by SIGINT."""
    atexit.unregister(_end_by_sigint_after_the_exit_callbacks)
    atexit._run_exitfuncs()
    end_at_once(signal.SIGINT)


def end_at_once(signum: int) -> NoReturn:
    """End the process now, without cleaning up, what was printed flushed: after Ctrl-C by SIGINT
    itself, as its default action does (why the signal and not status 130: end_as_interrupted),
    after another signal with the status a shell gives a process that signal ended."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signum)  # after SIGINT, reached only where the signal is blocked


def run_command(action: Callable[[], object]) -> None:
    """Run a command's work (generate.py's, evaluate.py's, export.py's) as a shell tool ends: a
    user's error on one line (exit_on_user_error), Ctrl-C without a traceback, ended by SIGINT
    (end_as_interrupted: what was printed stays on screen; what the command was writing is its
    own to clean up, as export.py's staging directory is), and a reader of stdout that stopped
    early (`| head`) quietly."""
    try:
        exit_on_user_error(action)
    except KeyboardInterrupt:
        end_as_interrupted(newline=True)
    except BrokenPipeError:
        exit_on_broken_pipe()


def one_line(error: BaseException) -> str:
    """The message of `error` on one line. OmegaConf's, ValueErrors, add lines naming the key
    (`full_key`); one that could not resolve an interpolation, `${...}` in a value the shell
    handed over (prompt="${x}"), says how to keep the text as it is."""
    key = getattr(error, "full_key", None)
    message = f"{key}: {str(error).splitlines()[0]}" if key else str(error)
    if type(error).__name__.startswith("Interpolation"):  # omegaconf.errors', not imported
        message += (
            ": Hydra reads ${...} in a value as an interpolation; write \\${...} to keep it as text"
        )
    return message


def is_int(value: object, minimum: int | None = None) -> bool:
    """An int (never a bool), at least `minimum` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return minimum is None or value >= minimum


def is_number(value: object) -> bool:
    """An int or a finite float, never a bool: no option takes inf or nan (an infinite learning
    rate or attention scale would only end the run in NaN a step later)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)  # an int of any size is finite


def check(ok: bool, key: str, expected: str, value: object) -> None:
    """Raise `<key> must be <expected>, got <value>` unless ok."""
    if not ok:
        raise ValueError(f"{key} must be {expected}, got {value!r}")


def check_int(key: str, value: object, minimum: int = 1, optional: bool = False) -> None:
    """`value` is an integer >= minimum (or None, when optional)."""
    if optional and value is None:
        return
    expected = {1: "a positive integer", 0: "a non-negative integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    check(is_int(value, minimum), key, expected + (" or null" if optional else ""), value)


def check_seed(key: str, value: object) -> None:
    """A seed of ours: what numpy's RandomState takes too (Lightning seeds it), [0, 2**32)."""
    check(is_int(value, 0) and value < 2**32, key, "an integer in [0, 2**32)", value)


TYPE_NAMES = {
    int: "an integer",
    float: "a finite number",
    str: "a string",
    bool: "true or false",
    os.PathLike: "a path",
}


def _fits(value: object, expected: object) -> bool:
    if expected is type(None):
        return value is None
    if expected is float:
        return is_number(value)
    if expected is int:
        return is_int(value)
    if expected in (str, bool, os.PathLike):
        return isinstance(value, expected)
    if dataclasses.is_dataclass(expected):
        return isinstance(value, expected | dict)  # a nested config, or its dict from Hydra
    return True  # containers and the like: the config's own checks look inside


def config_from(cls: Callable[..., T], options: dict, prefix: str, where: str, **extra) -> T:
    """cls(**options, **extra) for the dataclass config `cls`, whose fields are the options a
    user sets under `prefix` (in `where`, for the message): a key that is none of them is a
    one-line error naming it and them, not a TypeError's traceback."""
    check_known(options, [field.name for field in dataclasses.fields(cls)], prefix, where)
    return cls(**options, **extra)


def check_known(keys: Iterable[str], names: list[str], prefix: str, where: str) -> None:
    """Every one of `keys` is one of `names`, the options set under `prefix` in `where`."""
    unknown = sorted(set(keys) - set(names))
    if unknown:
        raise ValueError(
            f"{prefix}{unknown[0]} is not an option of {where}; its options are {', '.join(names)}"
        )


def check_field_types(config: object, prefix: str) -> None:
    """Raise a ValueError for the first field of the dataclass `config` whose value is not of
    its annotated type (an int passes for a float; a bool is never a number), before any range
    check compares it with a number: `optim.lr=abc` from the shell names optim.lr."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        union = get_origin(field.type) in (Union, types.UnionType)
        expected = get_args(field.type) if union else (field.type,)
        if not any(_fits(value, kind) for kind in expected):
            text_only = str in expected and not {int, float, bool} & set(expected)
            if text_only and isinstance(value, int | float):
                raise ValueError(not_text(f"{prefix}{field.name}", value))
            kinds = " or ".join(
                TYPE_NAMES.get(k, "null" if k is type(None) else str(k)) for k in expected
            )
            raise ValueError(f"{prefix}{field.name} must be {kinds}, got {value!r}")


def not_text(key: str, value: object) -> str:
    """The message for a text option that Hydra read as a number or true/false (`ckpt=0`, a
    sweep job's folder; `prompt=42`): the fix is quoting it."""
    shown = str(value).lower() if isinstance(value, bool) else value
    return (
        f"{key}={shown} is not text: Hydra reads numbers and true/false as such; quote it, "
        f"e.g. '{key}=\"{shown}\"'"
    )


def check_writable(path: Path, shown: str, fix: str) -> None:
    """Raise `<shown> cannot be written (<why>): <fix>` unless a file can be made in the folder
    that is to hold `path`, or the nearest one above it that exists (the commands make the
    rest). Commands check this before their long work, which would otherwise end in a
    traceback after it; making a file is the test that permissions, a read-only disk and a
    path through a file all fail as the real write would."""
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"{shown} cannot be written ({error.strerror} in {folder}): {fix}"
        ) from None
