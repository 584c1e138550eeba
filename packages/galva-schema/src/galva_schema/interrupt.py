"""Ctrl-C and SIGTERM end every Galva command the same way: one line ``PROG: interrupted (SIGINT)``, exit status
128 + the signal (130, 143: what a shell reports for a process the signal ended), no traceback, nothing half-written.

:func:`run_command` wraps a command's body. The first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread:
a ``BaseException``, so ``except Exception`` blocks let it pass while ``finally`` blocks and the atomic writers remove
their temporary files on the way out; the wrapper then prints the line and returns the status.

A main thread blocked in native code (a collective whose peer has gone, a store lookup) runs no Python signal handler
until that call returns, which may be minutes. A helper thread, woken by the signal through
:func:`signal.set_wakeup_fd`, therefore ends the process itself (the same line and status) when the handler has not
run :data:`GRACE_S` seconds after the signal. Code that installs its own handler for the signal meanwhile (torch's
elastic agent in :func:`galva_comm.launch.launch_local`, galva-hp's training watchdog) owns it and is left alone.

In a job of several ranks one process says it (:func:`say_interrupted`; under galva-comm's launcher, the launcher
prints what the first rank wrote): Ctrl-C reaches every rank, the job prints one line. A command's process, once
unwound, ends without interpreter finalization (``end_process``). Forked workers are started inside :func:`forking`
and call :func:`forked_worker` first: the parent alone decides how the job ends (it stops them), and no worker prints
a traceback of its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a child is waited for: a command that starts none never loads it
    import subprocess

__all__ = [
    "GRACE_S",
    "NOTE_ENV",
    "SIGNALS",
    "Interrupted",
    "exit_status",
    "forked_worker",
    "forking",
    "interrupted_line",
    "run_command",
    "say_interrupted",
    "wait_child",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that interrupt a command."""
GRACE_S = 3.0
"""Seconds the main thread gets to run the signal handler before the helper thread ends the process."""
UNWIND_S = 30.0
"""Seconds the main thread gets to unwind (remove temporary files, stop children) once the handler ran."""
CHILD_GRACE_S = 15.0
"""Seconds :func:`wait_child` gives a child to end after the signal was passed on to it, before killing it."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised in the main thread by :func:`run_command`'s handler."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted ({signal.Signals(self.signum).name})")

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


def exit_status(signum: int) -> int:
    """The status a shell reports for a process that ``signum`` ended: 128 + the signal number."""
    return 128 + int(signum)


def interrupted_line(prog: str, signum: int) -> str:
    """The one line an interrupted command prints: ``PROG: interrupted (SIGINT)``."""
    return f"{prog}: interrupted ({signal.Signals(signum).name})"


NOTE_ENV = "GALVA_INTERRUPT_NOTE"
"""Set by a launcher (:func:`galva_comm.launch.launch_local`) for its ranks: a file path that the first process of the
job to be interrupted creates, writing its line into it; the launcher, the job's one voice, prints it (or not: a job
that failed and whose other ranks the launcher then stopped was not interrupted)."""


def say_interrupted(prog: str, signum: int, detail: str = "") -> bool:
    """Say ``PROG: interrupted (SIGNAL)`` + ``detail`` unless another process of the job says it; True if said.

    Under a launcher that names a note file (:data:`NOTE_ENV`) the first process to create it writes the line there
    for the launcher to print; otherwise a lone process or rank 0 of a job of several (``$RANK`` unset or 0) prints it.
    """
    line = interrupted_line(prog, signum) + detail
    note = os.environ.get(NOTE_ENV)
    if note:
        try:
            fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        except OSError:  # an unwritable note: rank 0 prints it, as without a note
            pass
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(line)
            return True
    if os.environ.get("RANK", "0") != "0":
        return False
    print(line, file=sys.stderr, flush=True)
    return True


class _Held:
    """The signal :func:`forking` holds back: the blocks open in the main thread, and the signal the handler took
    meanwhile (raised as the outermost block ends)."""

    depth = 0
    signum: int | None = None


_HELD = _Held()


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around forking workers that call :func:`forked_worker`: SIGINT and SIGTERM are held back until the block ends,
    then raised as :class:`Interrupted` there. Blocked in this thread, so a worker inherits them blocked and none runs
    this process's handler before it has its own; and :func:`run_command`'s handler defers them meanwhile, for the
    kernel gives a process's signal to any thread not blocking it, and Python then runs the handler in this one at
    once: inside a ``Process.start`` between its fork and its return, where the caller never learned of the child
    it had started (a rank left behind by a Ctrl-C)."""
    masked = hasattr(signal, "pthread_sigmask")  # Windows: no signal masks (and no fork)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS) if masked else None
    # the handler runs in the main thread: a block in another thread must not hold its signal (raised there)
    main = threading.current_thread() is threading.main_thread()
    _HELD.depth += int(main)
    try:
        yield
    finally:
        _HELD.depth -= int(main)
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # type: ignore[arg-type]
        held, _HELD.signum = (_HELD.signum, None) if main and _HELD.depth == 0 else (None, _HELD.signum)
        if held is not None:
            raise Interrupted(held)


def forked_worker() -> None:
    """First thing in a forked worker (a pool worker, a forked rank; see :func:`forking`): Ctrl-C is left to the
    parent (ignored here), SIGTERM, the parent's way to stop it, ends it at once, and the parent's wakeup pipe is
    let go."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


_RUNNING: list[_Guard] = []
"""The :func:`run_command` calls running now (one per command; nested in tests calling ``main``)."""


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` again where an error is caught that the interrupt itself may have caused: native
    code calling back into Python (a safetensors read building its tensor) turns the handler's exception into an
    error of its own, which would otherwise end the command as a damaged file instead of an interrupted command."""
    for guard in _RUNNING:
        if guard.signum is not None:
            raise Interrupted(guard.signum)


class _Guard:
    """The state of one :func:`run_command` call: its handlers, its wakeup pipe and the thread reading it."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.signum: int | None = None  # the signal the handler raised for
        self.late: int | None = None  # a signal that landed once ``done`` was set: kept, not raised
        self.handled = threading.Event()  # the main thread ran the handler: it is unwinding in Python
        self.done = threading.Event()  # the body returned or raised
        self.said = threading.Lock()  # the line is printed once, by the main thread or the helper thread
        self.reader, self.writer = _wakeup_pair()
        self.old_handlers: dict[int, Any] = {}
        self.old_wakeup_fd: int | None = None  # None until this guard set its own
        self.thread = threading.Thread(target=self._watch, name="galva-interrupt", daemon=True)

    def install(self) -> None:
        """Take the signals. A signal may land half-way (the handler is live from the first ``signal.signal`` on):
        :meth:`uninstall` then undoes only what was done."""
        _RUNNING.append(self)
        for signum in SIGNALS:
            self.old_handlers[signum] = signal.signal(signum, self._handler)
        self.old_wakeup_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.thread.start()

    def mute(self) -> None:
        """From now on a signal is kept, not raised: the body has ended, and :meth:`uninstall` must not be cut
        half-way (a rank's SIGTERM from its launcher landed on its first line once, a traceback on CI)."""
        self.done.set()

    def uninstall(self, finished: bool = False) -> None:
        """Stop watching; with ``finished`` (the command's process, its work done) the signals are ignored from now
        on instead of handed back: the exit status stays the command's through the interpreter's shutdown. Without
        it, a signal kept since :meth:`mute` goes to the handler handed back."""
        self.done.set()
        if self in _RUNNING:
            _RUNNING.remove(self)
        with contextlib.suppress(OSError):
            self.writer.send(b"\0")  # wakes the thread; signal numbers are never 0
        if self.thread.ident is not None:  # started (install may have been interrupted before)
            self.thread.join(timeout=1.0)
        if self.old_wakeup_fd is not None:
            signal.set_wakeup_fd(self.old_wakeup_fd)
        for signum, handler in self.old_handlers.items():
            signal.signal(signum, signal.SIG_IGN if finished else handler)
        self.reader.close()
        self.writer.close()
        if self.late is not None and not finished:
            signal.raise_signal(self.late)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.handled.is_set():
            return  # a second signal while the first unwinds: the thread holds the deadline
        if self.done.is_set():
            self.late = int(signum)
            return
        self.handled.set()
        self.signum = int(signum)
        if _HELD.depth:  # inside forking(): it raises it as it ends
            _HELD.signum = self.signum
            return
        raise Interrupted(signum)

    def say(self, signum: int) -> None:
        if self.said.acquire(blocking=False):
            say_interrupted(self.prog, signum)

    def _watch(self) -> None:
        signum = self._first_signal()
        if signum is None:
            return
        if signal.getsignal(signum) != self._handler:
            return  # another handler owns the signal now (torch's elastic agent, the training watchdog)
        if not self.handled.wait(GRACE_S) and not self.done.is_set():
            self._force(signum)  # the main thread is stuck in native code
        elif not self.done.wait(UNWIND_S):
            self._force(signum)

    def _first_signal(self) -> int | None:
        while not self.done.is_set():
            ready, _, _ = select.select([self.reader], [], [])
            if not ready:
                continue
            try:
                data = self.reader.recv(64)
            except BlockingIOError:
                continue
            except OSError:
                return None
            for byte in data:
                if byte in SIGNALS:
                    return int(byte)
        return None

    def _force(self, signum: int) -> None:
        if self.done.is_set():
            return
        self.say(signum)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(exit_status(signum))


class _PipeEnd:
    """One end of a non-blocking pipe with the socket methods :class:`_Guard` uses (POSIX)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self.fd

    def recv(self, size: int) -> bytes:
        return os.read(self.fd, size)

    def send(self, data: bytes) -> int:
        return os.write(self.fd, data)

    def close(self) -> None:
        os.close(self.fd)


def _wakeup_pair() -> tuple[Any, Any]:
    """(reader, writer) of the signal wakeup: a pipe on POSIX (no socket and selectors imported at every command's
    start-up, ~0.02 s), a socket pair on Windows (where the wakeup fd must be a socket)."""
    if os.name == "nt":
        import socket

        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        return reader, writer
    read_fd, write_fd = os.pipe()
    return _PipeEnd(read_fd), _PipeEnd(write_fd)


def run_command(prog: str, body: Callable[[], int], *, end_process: bool = False) -> int:
    """Run a command's ``body`` and return its exit status; SIGINT or SIGTERM end it with one line and 128 + signal.

    ``end_process``: this is the command's process (its console script, ``argv`` from the command line, not a test
    calling ``main``). Once interrupted and unwound it then ends at once, without interpreter finalization: with torch
    loaded that takes seconds, and in a rank, collectives in flight and the native threads serving them must neither
    hold up nor abort its exit (``terminate called ...``). Once ``body`` has returned, success wins: SIGINT and SIGTERM
    are ignored while Python shuts down, so the exit status is ``body``'s, never a silent death by the signal.
    Outside the main thread ``body`` simply runs.
    """
    if threading.current_thread() is not threading.main_thread():
        return body()
    guard = _Guard(prog)
    finished = False
    try:
        try:
            # inside the try: the handler is live from install's first step on, and a signal landing before the try
            # (Ctrl-C the moment a rank reached this) raised past it, a traceback instead of the line
            guard.install()
            status = body()
            finished = end_process  # the work is done and its outputs whole: a later signal does not undo that
            return status
        finally:
            guard.mute()  # a signal landing here is raised, and caught below; once muted it is kept
    except Interrupted as err:
        return _ended(guard, err.signum, end_process)
    except KeyboardInterrupt:  # raised by a library's own SIGINT handler, or before ours was installed
        return _ended(guard, signal.SIGINT, end_process)
    finally:
        guard.uninstall(finished)


def _ended(guard: _Guard, signum: int, end_process: bool) -> int:
    guard.say(signum)
    if end_process:
        guard.done.set()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(exit_status(signum))
    return exit_status(signum)


def wait_child(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> int:
    """Wait for a child command; when this process is interrupted meanwhile, pass the signal on to the child, give it
    :data:`CHILD_GRACE_S` seconds to end the same way (removing its temporary files), then kill it, and re-raise.

    Start the child with ``start_new_session=True``: Ctrl-C at a terminal then reaches this process only, and the
    child gets the signal exactly once, from here.
    """
    import subprocess

    try:
        return proc.wait()
    except BaseException as err:
        if isinstance(err, Interrupted):
            signum = err.signum
        else:
            signum = signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM
        with contextlib.suppress(OSError):
            proc.send_signal(signum)
        try:
            proc.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
