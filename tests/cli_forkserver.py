"""Run ``python -m fl_platform.run <args>`` many times without paying its imports each time.

tests/test_cli.py's bad-input cases each need a fresh CLI process (a fresh Hydra, the exit code, stderr),
and a fresh interpreter spends most of a failing call importing torch, Hydra and the registries. This
process imports them once and forks one child per request; the child runs the module as ``-m`` would
(``runpy``, ``__main__``) in the request's working directory and environment, with stdout and stderr
written to the request's files, and exits with the CLI's code. One JSON request per stdin line:
``{"args", "cwd", "env", "stdout", "stderr", "timeout"}``; one JSON reply per line: ``{"returncode"}``
(-9 when the child outlived its timeout and was killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import fl_platform.api  # (what the CLI imports when it runs: torch, the engine, the data)
import fl_platform.run  # (Hydra and the config registries)


def child(request: dict) -> None:
    """In the forked child: become ``python -m fl_platform.run <args>`` and never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [fl_platform.run.__file__, *request["args"]]
        try:
            runpy.run_module("fl_platform.run", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int | None):
                print(exit_.code, file=sys.stderr)
        except BaseException:  # what an uncaught exception does to `python -m`: traceback, exit 1
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not change the exit code
                stream.flush()
        os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        deadline = time.monotonic() + float(request.get("timeout", 240))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = -signal.SIGKILL
                break
            time.sleep(0.02)
        print(json.dumps({"returncode": code}), flush=True)


if __name__ == "__main__":
    serve()
    sys.stdout.flush()
    os._exit(0)  # stdin closed: done; torch's interpreter shutdown would only delay the test's teardown
