"""`dflash` commands for the tests, each in a process of its own forked from one that has already
imported the package and its libraries.

A fresh `python -m dflash_mlx.cli.main` spends about 2.5 s importing mlx-lm, which imports
transformers, before the command starts; the tests start a few hundred. Here one long-lived
process per test worker (the "zygote") imports them once, runs no MLX operation (so it holds no
thread a fork would lose), and forks a child per command. The child is a real process: its own
standard streams (files), environment, working directory, exit code and signals; it runs the same
:func:`dflash_mlx.cli.main.main` the console script runs.

What a fork cannot give falls back to a fresh process (:func:`dflash`): other :func:`subprocess.run`
arguments (a ``preexec_fn``, a stream of the caller's), or an
environment that changes what a library reads when it is imported (``HF_*``, ``TRANSFORMERS_*``,
``PYTHON*``, ``LD_*``, ``MLX_*``, ``OPENBLAS_*``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "dflash_mlx.cli.main"]
READ_AT_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "PYTHON", "LD_", "MLX_", "OPENBLAS")
LIBRARIES = ("mlx_lm", "mlx_lm.tokenizer_utils", "transformers", "tokenizers", "sentencepiece", "jinja2",
             "pydantic", "typer", "rich", "starlette", "uvicorn", "httpx", "prometheus_client", "numpy")


# -- the zygote (this file run as a script) ----------------------------------------------------


def _preload() -> None:
    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import dflash_mlx

    for info in pkgutil.walk_packages(dflash_mlx.__path__, "dflash_mlx."):
        importlib.import_module(info.name)


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """In the forked child: the request's streams, environment and folder, then ``dflash ARGS``; never returns."""
    code = 1
    try:
        for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            if path is None:  # standard error into standard output
                os.dup2(1, fd)
                continue
            f = os.open(path, flags, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["dflash", *request["args"]]
        from dflash_mlx.cli.main import main

        try:
            main(request["args"])
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _zygote(control_in: int, control_out: int) -> None:
    """Fork a child per request line; write ``started PID`` at once and ``exit PID CODE`` when it ends."""
    _preload()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    say = lambda line: os.write(control_out, (line + "\n").encode())  # noqa: E731
    if threads != 1:  # a fork would lose them: the tests then start fresh processes
        return say(f"unsafe {threads} threads")
    say("ready")
    buffer, children = b"", set()
    while True:
        readable = select.select([control_in], [], [], 0.05 if children else None)[0]
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
        if not readable:
            continue
        data = os.read(control_in, 65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                os.close(control_in)
                os.close(control_out)
                _child(json.loads(line))
            children.add(pid)
            say(f"started {pid}")


# -- the tests' side ---------------------------------------------------------------------------


class _Zygote:
    def __init__(self):
        to_child, self._control = os.pipe()
        self._replies, from_child = os.pipe()
        self.proc = subprocess.Popen([sys.executable, __file__, str(to_child), str(from_child)], cwd=ROOT,
                                     pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.env = dict(os.environ)
        self._buffer, self.exits = b"", {}
        first = self._line(300)
        self.ready = first == "ready"
        if not self.ready:  # said once per worker; the commands still run, in fresh processes
            warnings.warn(f"dflash commands start fresh processes (no fork server: {first or 'it exited'})")
        atexit.register(self.proc.kill)

    def _line(self, timeout: Optional[float]) -> Optional[str]:
        """The next reply line ("" once the zygote is gone), or None after ``timeout`` seconds."""
        while b"\n" not in self._buffer:
            if not select.select([self._replies], [], [], timeout)[0]:
                return None
            data = os.read(self._replies, 4096)
            if not data:
                return ""
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def pump(self, timeout: Optional[float]) -> Optional[str]:
        """The next reply line, or None after ``timeout`` seconds; a child's exit is also kept in ``exits``."""
        line = self._line(timeout)
        if line and line.startswith("exit "):
            _, pid, code = line.split()
            self.exits[int(pid)] = int(code)
        return line

    def spawn(self, request: dict) -> int:
        os.write(self._control, (json.dumps(request) + "\n").encode())
        while (reply := self.pump(60)) and reply.startswith("exit "):
            pass
        assert reply and reply.startswith("started "), f"the fork server did not start the command: {reply!r}"
        return int(reply.split()[1])


class ForkedProcess:
    """A command the zygote forked, as much of :class:`subprocess.Popen` as the tests use."""

    def __init__(self, zygote: _Zygote, pid: int, args: list):
        self.zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.zygote.pump(0)
            self.returncode = self.zygote.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.zygote.pump(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_ZYGOTE: Optional[_Zygote] = None


def _zygote_for(env: dict) -> Optional[_Zygote]:
    global _ZYGOTE
    if _ZYGOTE is None:
        _ZYGOTE = _Zygote()
    changed = {k for k in set(env) | set(_ZYGOTE.env) if env.get(k) != _ZYGOTE.env.get(k)}
    if not _ZYGOTE.ready or any(k.startswith(READ_AT_IMPORT) for k in changed):
        return None
    return _ZYGOTE


def _fork(zygote: _Zygote, args, stdin: str, stdout: str, stderr: Optional[str], env: dict, cwd) -> ForkedProcess:
    """``dflash ARGS`` forked with these standard streams (``stderr`` None: into ``stdout``), environment and
    folder (None: this one)."""
    args = [os.fsdecode(a) for a in args]  # bytes as Python decodes a process's arguments
    request = dict(args=args, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=str(cwd or os.getcwd()))
    return ForkedProcess(zygote, zygote.spawn(request), COMMAND + args)


def dflash(*args: str, input=None, env: Optional[dict] = None, cwd=None, timeout: Optional[float] = 120,
           text: bool = False, **popen) -> subprocess.CompletedProcess:
    """``dflash ARGS`` as :func:`subprocess.run` with ``capture_output=True`` would run it (``input``: str or
    bytes for its standard input, else /dev/null; ``env``: its whole environment), forked when it can be.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (it is killed).
    """
    env = dict(os.environ if env is None else env)
    zygote = None if popen else _zygote_for(env)
    if zygote is None:
        streams = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       stdin=None if input is not None else subprocess.DEVNULL)
        return subprocess.run(COMMAND + list(args), input=input, env=env, cwd=cwd, timeout=timeout, text=text,
                              **{**streams, **popen})
    folder = tempfile.mkdtemp(prefix="dflash-cli-")
    try:
        paths = [os.path.join(folder, name) for name in ("stdin", "stdout", "stderr")]
        data = input.encode() if isinstance(input, str) else (input or b"")
        Path(paths[0]).write_bytes(data)
        proc = _fork(zygote, args, *paths, env, cwd)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out, err = (Path(p).read_bytes() for p in paths[1:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if text:
        out, err = out.decode(), err.decode()
    return subprocess.CompletedProcess(COMMAND + list(args), code, out, err)


def spawn_dflash(*args: str, log: Path, env: Optional[dict] = None):
    """``dflash ARGS`` started and left running, standard output and error into ``log``, standard input
    /dev/null: a :class:`ForkedProcess`, or a :class:`subprocess.Popen` where a fork cannot serve."""
    env = dict(os.environ if env is None else env)
    zygote = _zygote_for(env)
    if zygote is None:
        with open(log, "w") as out:
            return subprocess.Popen(COMMAND + list(args), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
    return _fork(zygote, args, os.devnull, str(log), None, env, None)


if __name__ == "__main__":
    _zygote(int(sys.argv[1]), int(sys.argv[2]))
