"""Start scripts as processes forked from one interpreter that has imported torch.

Run by tests/test_faults.py and tests/test_exits.py instead of one ``python
script.py`` per process: a process that builds DDP imports torch,
torch._dynamo (DDP's constructor does) and aps_comm, several seconds of CPU
per process on a small machine, while the test is about what the process does
after that. Here that import happens once; each started process then runs the
script as ``python script.py ARGS`` would, nothing watching it but this
starter, which only reaps it:

* it starts its own session (so the test can find anything it left running),
  takes the request's environment as its whole environment, writes stdout and
  stderr to the request's log, and runs the script as ``__main__``;
* an uncaught exception prints its traceback and exits 1, ``sys.exit(n)``
  exits n, and the interpreter's own shutdown runs at the end (atexit
  handlers, threads still alive): the same exit as the script's.

Protocol: the starter prints ``READY`` once it has imported what the scripts
need; then, one JSON request per line on stdin: a list of processes, each
``{"script": PATH, "args": [...], "env": {...}, "log": PATH}``, optionally
with ``"cwd": PATH`` (the process's working folder; else the starter's) and
``"preload": [MODULE, ...]`` (imported by the starter before it forks, for
every later process too: tests/test_readme.py's scripts import Lightning,
Accelerate, Transformers, TensorBoard). The starter
prints ``STARTED <pid> ...`` (in request order), then ``EXITED <pid> <code>
<time.time()>`` as each ends (code negative: killed by that signal), then
``DONE``; then it reads the next request. It ends when stdin closes.
"""

import importlib
import json
import os
import runpy
import sys
import time

# What the scripts started here import (fault_train.py, exit_codes.py), so that
# none of them imports it again: torch, DDP's torch._dynamo, aps_comm's hook
# and numba's CPU target (aps_comm.rank_preload), and the launcher's API.
import torch  # noqa: F401

import aps_comm.rank_preload  # noqa: F401
import aps_launch  # noqa: F401

print("READY", flush=True)
request = None
while request is None:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    started = {}
    specs = json.loads(line)
    for module in {name for spec in specs for name in spec.get("preload", [])}:
        importlib.import_module(module)
    for spec in specs:
        pid = os.fork()
        if pid == 0:
            request = spec
            break
        started[pid] = spec
    if request is not None:
        break
    print("STARTED", *started, flush=True)
    while started:
        pid, status = os.waitpid(-1, 0)
        if started.pop(pid, None) is not None:
            print("EXITED", pid, os.waitstatus_to_exitcode(status), repr(time.time()), flush=True)
    print("DONE", flush=True)

# The started process: from here on, what `python script ARGS` would do.
os.setsid()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(log, 1)
os.dup2(log, 2)
os.close(log)
# The starter's stdin object may hold requests it read ahead; stdout and stderr
# (flushed) now write to the log through the descriptors under them.
sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stdin)
os.environ.clear()
os.environ.update(request["env"])
if "cwd" in request:
    os.chdir(request["cwd"])
script = request["script"]
sys.argv = [script, *request["args"]]
sys.path[0] = os.path.dirname(os.path.abspath(script))
del request, started, line, specs, spec, pid
runpy.run_path(script, run_name="__main__")
