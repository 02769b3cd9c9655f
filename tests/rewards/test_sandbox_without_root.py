"""The sandbox run by an ordinary user: most layers still hold, built in an unprivileged user namespace.

The test drops to ``nobody`` with ``setpriv`` and runs a script there with an interpreter that user
may execute (this one if it is world-accessible, else the system's ``python3``), importing a
world-readable copy of the sandbox's modules (they need the standard library only). Skipped where
that is not possible (not root, no ``setpriv``, no such interpreter) or where the system refuses
unprivileged user namespaces (then the sandbox warns and runs with fewer layers, by design).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import lit_grpo_rewards
import pytest

NOBODY = 65534

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    from lit_grpo_rewards.sandbox import run_in_sandbox

    def run(code, tests=("assert WORKED",), **kw):
        return run_in_sandbox(code, tests=list(tests), audit_hook=False, timeout=10, **kw).test_results

    out = {"layers": run_in_sandbox("pass", tests=[]).layers}
    out["correct"] = run("def add(a, b):\\n    return a + b\\n", ["assert add(1, 2) == 3"])
    out["forged"] = run("class I(int):\\n    def __eq__(self, o):\\n        return True\\n"
                        "    __hash__ = int.__hash__\\ndef add(a, b):\\n    return I(0)\\n", ["assert add(1, 2) == 3"])
    out["signal_the_trainer"] = run(
        "import os\\nWORKED = False\\ntry:\\n    os.kill(%d, 0)\\n    WORKED = True\\nexcept OSError:\\n    pass\\n" % os.getpid())
    out["read_a_data_file"] = run(
        "WORKED = False\\ntry:\\n    WORKED = bool(open(%r).read())\\nexcept OSError:\\n    pass\\n" % sys.argv[2])
    out["write_outside"] = run(
        "WORKED = False\\ntry:\\n    open('/tmp/pwned-%d', 'w').write('x')\\n    WORKED = True\\nexcept OSError:\\n    pass\\n" % os.getpid())
    out["forked"] = run("import os, time\\nN = 0\\nfor _ in range(64):\\n    try:\\n        if os.fork() == 0:\\n"
                        "            time.sleep(30)\\n            os._exit(0)\\n        N += 1\\n    except OSError:\\n"
                        "        break\\nWORKED = N <= 8", max_processes=8)
    out["unix_socket"] = run("import socket\\nWORKED = False\\ntry:\\n    socket.socket(socket.AF_UNIX)\\n"
                             "    WORKED = True\\nexcept OSError:\\n    pass\\n")
    out["signal_the_group"] = run(
        "import os, signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nos.kill(0, signal.SIGTERM)\\n"
        "time.sleep(0.3)\\nWORKED = True\\n")
    stdin_run = run_in_sandbox(
        "import os\\nwrote = []\\nfor attempt in (lambda: os.write(0, b'x'),\\n"
        "                lambda: os.write(os.open('/proc/self/fd/0', os.O_RDWR), b'x')):\\n"
        "    try:\\n        attempt()\\n        wrote.append(1)\\n    except OSError:\\n"
        "        pass\\nprint(input(), len(wrote))\\n", stdin=b"hello\\n", audit_hook=False, timeout=10)
    out["stdin_run"] = [stdin_run.returncode, stdin_run.stdout.decode()]
    time.sleep(0.5)
    out["left"] = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
                   and os.stat("/proc/" + p).st_uid == os.getuid()]
    print(json.dumps(out))
''')


def _interpreter_for_nobody() -> str | None:
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")):
        if not candidate:
            continue
        probe = subprocess.run(  # it must be able to start itself again as that user: the sandbox does
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", candidate, "-c",
             "import subprocess, sys; assert sys.version_info >= (3, 8); "
             "subprocess.run([sys.executable, '-c', 'import json'], check=True)"],
            capture_output=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=30)
        if probe.returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="module")
def as_nobody():
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (to become nobody) and setpriv")
    python = _interpreter_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter that nobody may run")
    root = tempfile.mkdtemp(prefix="lit-grpo-nonroot-", dir="/tmp")
    package = os.path.join(root, "lit_grpo_rewards")
    os.makedirs(package)
    here = os.path.dirname(lit_grpo_rewards.__file__)
    shutil.copytree(os.path.join(here, "sandbox"), os.path.join(package, "sandbox"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    open(os.path.join(package, "__init__.py"), "w").close()
    script = os.path.join(root, "script.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    data = os.path.join(root, "data.jsonl")
    with open(data, "w") as f:
        f.write('{"output": "3"}\n')
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    try:
        proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python,
                               "-I", script, root, data], capture_output=True, text=True, cwd="/tmp",
                              env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, timeout=300)
        assert proc.returncode == 0, proc.stderr
        yield json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
    finally:
        shutil.rmtree(root)


def test_layers_without_root(as_nobody):
    out, warnings = as_nobody
    layers = out["layers"]
    if not layers.get("user_namespace"):
        pytest.skip(f"this system refuses unprivileged user namespaces (layers: {layers})")
    for name in ("pid_namespace", "network_namespace", "ipc_namespace", "mount_namespace", "minimal_root",
                 "read_only_root", "scratch_tmpfs", "minimal_dev", "separate_judge", "rlimits",
                 "capabilities_dropped", "judge_capabilities_dropped", "final_sweep"):
        assert layers.get(name) is True, (name, layers)
    assert layers.get("own_uid") is False
    assert "running without the sandbox's own uid" in warnings


def test_attacks_without_root(as_nobody):
    out, _ = as_nobody
    if not out["layers"].get("user_namespace"):
        pytest.skip("this system refuses unprivileged user namespaces")
    assert out["correct"] == [True]
    assert out["forged"] == [False]
    assert out["signal_the_trainer"] == [False]
    assert out["read_a_data_file"] == [False]
    assert out["write_outside"] == [False]
    assert out["forked"] == [True]
    if out["layers"].get("seccomp"):
        assert out["unix_socket"] == [False]
    assert out["signal_the_group"] == [True]  # the judge, in another process group, survived
    assert out["stdin_run"] == [0, "hello 0\n"]  # stdin read, never written (nor reopened for writing)
    assert out["left"] == []
