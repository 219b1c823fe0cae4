"""Daemon threads that allocate through gpupool while the interpreter exits (issue 40, defect
8): with history keeping Python stacks, gpupool takes the GIL to read a thread's frames, and
CPython ends a thread that waits for the GIL while it finalises (pthread_exit, a forced unwind
through gpupool's frames). gpupool's C entry point caught the unwind as a panic and the process
aborted ("FATAL: exception not rethrown", status 134) in 8 runs of 10. Each run here is a
fresh interpreter that must exit 0, 20 runs a stack setting."""

import os
import subprocess
import sys

import pytest

PROGRAM = r"""
import sys, threading, time
import gpupool

gpupool.record_history(True, "all", 100000, stacks=sys.argv[1])
started = threading.Barrier(9)

def churn(stream):
    started.wait()
    while True:
        p = gpupool.malloc(4096 + stream, 0, stream)
        gpupool.free(p)

for i in range(8):
    threading.Thread(target=churn, args=(0x100 * (i + 1),), daemon=True).start()
started.wait()
time.sleep(0.02)
print("exiting", flush=True)
# The interpreter finalises with the daemon threads inside gpupool, or waiting for the GIL in it.
"""


@pytest.mark.parametrize("stacks", ["python", "all"])
def test_daemon_threads_inside_gpupool_do_not_abort_the_exit(stacks, tmp_path):
    script = tmp_path / "daemons.py"
    script.write_text(PROGRAM)
    env = dict(os.environ)
    failures = []
    for run in range(20):
        p = subprocess.run([sys.executable, str(script), stacks], env=env, capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0 or "exiting" not in p.stdout:
            failures.append(f"run {run}: status {p.returncode}: {p.stderr[-500:]}")
    assert not failures, f"{len(failures)} of 20 runs failed:\n" + "\n".join(failures)
