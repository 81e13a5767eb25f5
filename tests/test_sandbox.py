"""Issue 44: an agent's commands in a sandbox reach their workspace and the endpoint, nothing else of the trainer.

The reproducer suite: each attack runs as a real process (stdlib Python) in a real sandbox, and each is also shown to
succeed without one (`sandbox="none"`), so that these tests can fail. bubblewrap tests are skipped, with the reason,
where `bwrap` is missing or user namespaces are refused.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pyarrow as pa
import pytest

from trl_agentic.sandbox import (
    BwrapSandbox,
    NoSandbox,
    SandboxLimits,
    bwrap_unavailable,
    create_sandbox,
    docker_unavailable,
    open_sandbox,
    resolve_kind,
)
from trl_agentic.sandbox.bwrap import processes_limited
from trl_agentic.sandbox.cgroups import cgroup_limits, make_cgroups, release, sweep_stale
from trl_agentic.sandbox.netns import setns_unavailable


PYTHON = os.path.realpath(sys.executable)  # the base interpreter: `-I -S` runs on its standard library only
BWRAP_MISSING = bwrap_unavailable()
needs_bwrap = pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"no local sandbox here: {BWRAP_MISSING}")
# The container backend runs where a Docker daemon answers and the image is there already (nothing is pulled).
DOCKER_IMAGE = os.environ.get("TRL_AGENTIC_TEST_DOCKER_IMAGE", "python:3.11-slim")


def docker_missing() -> str | None:
    reason = docker_unavailable()
    if reason is None:
        import docker

        try:
            docker.from_env().images.get(DOCKER_IMAGE)
        except Exception as error:  # noqa: BLE001
            return f"image {DOCKER_IMAGE} not present ({type(error).__name__}); pull it or set TRL_AGENTIC_TEST_DOCKER_IMAGE"
    return reason


DOCKER_MISSING = docker_missing()
needs_docker = pytest.mark.skipif(DOCKER_MISSING is not None, reason=f"no container backend here: {DOCKER_MISSING}")
KINDS = ["none", pytest.param("bwrap", marks=needs_bwrap)]
ATTACK_KINDS = [*KINDS, pytest.param("docker", marks=needs_docker)]


@pytest.fixture(autouse=True)
def quiet_no_sandbox():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="sandbox='none'")
        yield


def attack(kind, code, *, limits=None, sandbox=None, env=None):
    """Run `code` (Python, standard library) in a new sandbox of `kind`; its stdout, stripped."""
    sandbox = sandbox or create_sandbox(kind, limits=limits, image=DOCKER_IMAGE if kind == "docker" else None)
    environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(sandbox.home), **(env or {})}
    python = "python3" if kind == "docker" else PYTHON
    try:
        result = asyncio.run(sandbox.run([python, "-I", "-S", "-c", textwrap.dedent(code)], environment, timeout=60))
    finally:
        sandbox.destroy()
    assert result.exit_code == 0, result
    return result.stdout.strip()


READ = """
    import sys
    try:
        print("read:" + open(sys.argv[1] if len(sys.argv) > 1 else {path!r}, "rb").read().decode(errors="replace"))
    except OSError as error:
        print("denied:", type(error).__name__)
"""


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_another_concurrent_episodes_workspace_is_out_of_reach(kind):
    other = create_sandbox(kind)
    try:
        (other.workspace / "answer.py").write_text("ANSWER = 42")
        target = other.workspace / "answer.py"
        read = attack(kind, READ.format(path=str(target)))
        wrote = attack(
            kind,
            f"""
            try:
                open({str(target)!r}, "w").write("ANSWER = 'hacked'")
                print("wrote")
            except OSError as error:
                print("denied:", type(error).__name__)
        """,
        )
        if kind == "none":
            assert (read, wrote) == ("read:ANSWER = 42", "wrote")
            assert target.read_text() == "ANSWER = 'hacked'"
        else:
            assert read.startswith("denied:") and wrote.startswith("denied:")
            assert target.read_text() == "ANSWER = 42"
    finally:
        other.destroy()


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_the_checkers_dataset_file_is_out_of_reach(kind, tmp_path):
    # The answers column of a dataset's Arrow file, as `datasets` memory-maps it for the checker.
    path = tmp_path / "data-00000-of-00001.arrow"
    table = pa.table({"prompt": ["2+2?"], "answer": ["SECRET-ANSWER-4"]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    out = attack(kind, READ.format(path=str(path)))
    assert ("SECRET-ANSWER-4" in out) == (kind == "none"), out


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_the_trainers_home_and_token_are_out_of_reach(kind, tmp_path, monkeypatch):
    home = tmp_path / "trainer-home"
    token = home / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("hf_FAKE_TOKEN")
    monkeypatch.setenv("HOME", str(home))
    out = attack(kind, READ.format(path=str(token)))
    listing = attack(
        kind,
        f"""
        import os
        try:
            print(sorted(os.listdir({str(home)!r})))
        except OSError as error:
            print("denied:", type(error).__name__)
    """,
    )
    if kind == "none":
        assert (out, listing) == ("read:hf_FAKE_TOKEN", "['.cache']")
    else:
        assert out.startswith("denied:") and listing.startswith("denied:")


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_the_trainers_environment_in_proc_is_out_of_reach(kind):
    # A process of the trainer's user with a secret in its environment (as the trainer's own /proc/<pid>/environ).
    trainer = subprocess.Popen(
        [PYTHON, "-I", "-S", "-c", "import time; time.sleep(60)"], env={"HF_TOKEN": "hf_SECRET_IN_ENVIRON"}
    )
    try:
        out = attack(kind, READ.format(path=f"/proc/{trainer.pid}/environ"))
        assert ("hf_SECRET_IN_ENVIRON" in out) == (kind == "none"), out
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_writes_outside_the_workspace_do_not_reach_the_host(kind, tmp_path):
    outside = tmp_path / "outside.txt"
    out = attack(
        kind,
        f"""
        import os
        done = []
        for path in ({str(outside)!r}, "/tmp/trl-agentic-sandbox-escape.txt", os.path.join(os.getcwd(), "mine.txt")):
            try:
                open(path, "w").write("x")
                done.append(path)
            except OSError:
                pass
        print(len(done))
    """,
    )
    host_tmp = Path("/tmp/trl-agentic-sandbox-escape.txt")
    if kind == "none":
        assert out == "3" and outside.exists() and host_tmp.exists()
        host_tmp.unlink()
    else:
        # Its workspace and its private /tmp take writes; neither is the host's.
        assert out == "2" and not outside.exists() and not host_tmp.exists()


@pytest.fixture
def loopback_server():
    """A TCP service of the host on loopback, other than the endpoint (a database, a cloud metadata proxy...)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            client.sendall(b"HOST-SERVICE")
            client.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    listener.close()


CONNECT = """
    import socket
    try:
        with socket.create_connection(("127.0.0.1", {port}), timeout=5) as s:
            print("reached:" + s.recv(64).decode())
    except OSError as error:
        print("denied:", type(error).__name__)
"""


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_no_address_but_the_endpoint_is_reachable(kind, loopback_server):
    out = attack(kind, CONNECT.format(port=loopback_server))
    assert (out == "reached:HOST-SERVICE") == (kind == "none"), out
    if kind != "none":  # no route to any other host: loopback is its only interface
        outside = attack(kind, CONNECT.format(port=53).replace('"127.0.0.1"', '"1.1.1.1"'))
        assert outside == "denied: OSError", outside


# How the endpoint gets in: the trainer listening in the sandbox's network namespace (`setns`: root, CAP_SYS_ADMIN), or
# `init.py` inside (the fallback, what an unprivileged user gets); both forced here where they can run.
FORWARDERS = [
    pytest.param("setns", marks=pytest.mark.skipif(setns_unavailable() is not None, reason=f"{setns_unavailable()}")),
    "init",
]


@needs_bwrap
@pytest.mark.parametrize("forwarder", FORWARDERS)
def test_the_endpoint_is_forwarded_and_nothing_else(loopback_server, forwarder):
    # The port the sandbox forwards is the endpoint's: here the test's loopback service stands for it.
    sandbox = BwrapSandbox(forwarder=forwarder)
    assert sandbox.forwarder == forwarder
    url = sandbox.endpoint_url(f"http://127.0.0.1:{loopback_server}/v1")
    assert url == f"http://127.0.0.1:{loopback_server}/v1"
    with socket.create_server(("127.0.0.1", 0)) as other:  # another service of the host, on loopback too
        code = CONNECT.format(port=loopback_server) + CONNECT.format(port=other.getsockname()[1])
        assert attack("bwrap", code, sandbox=sandbox).splitlines() == [
            "reached:HOST-SERVICE",
            "denied: ConnectionRefusedError",
        ]


@needs_bwrap
@pytest.mark.parametrize("forwarder", FORWARDERS)
def test_no_process_outlives_its_episode_with_the_endpoint_forwarded(forwarder, loopback_server):
    marker = f"4{os.getpid() % 1000}.{time.monotonic_ns() % 10**6:06d}"
    sandbox = BwrapSandbox(forwarder=forwarder)
    sandbox.endpoint_url(f"http://127.0.0.1:{loopback_server}/v1")
    assert attack("bwrap", ESCAPE.format(marker=marker), sandbox=sandbox) == "started"
    time.sleep(0.3)
    left = alive_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


@needs_bwrap
def test_the_forwarder_setting_says_what_it_takes():
    assert BwrapSandbox().forwarder == ("setns" if setns_unavailable() is None else "init")
    with pytest.raises(ValueError, match="forwarder='socat': use one of"):
        BwrapSandbox(forwarder="socat")
    if setns_unavailable() is not None:
        with pytest.raises(RuntimeError, match="forwarder='setns': .*use forwarder='init'"):
            BwrapSandbox(forwarder="setns")


def alive_with(marker: str) -> list[int]:
    """Host pids whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


ESCAPE = """
    import os, subprocess
    subprocess.Popen(["setsid", "sleep", "{marker}"], start_new_session=True)  # a session of its own
    if os.fork() == 0:  # a double fork, detached
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", "{marker}1"])
        os._exit(0)
    os.wait()
    print("started")
"""


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_no_process_outlives_its_episode(kind):
    marker = f"3{os.getpid() % 1000}.{time.monotonic_ns() % 10**6:06d}"
    assert attack(kind, ESCAPE.format(marker=marker)) == "started"
    time.sleep(0.3)
    left = alive_with(marker)
    try:
        assert (len(left) == 2) == (kind == "none"), left
        if kind != "none":
            assert left == []
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


LIMITS = SandboxLimits(memory_bytes=512 << 20, processes=32, file_size_bytes=1 << 20, cpu_seconds=30)


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_memory_and_file_size_are_limited(kind):
    out = attack(
        kind,
        """
        got = []
        try:
            block = bytearray(800 << 20)
            got.append("memory")
        except MemoryError:
            pass
        try:
            open("big.bin", "wb").write(b"x" * (2 << 20))
            got.append("file")
        except OSError:
            pass
        print(",".join(got))
        """,
        limits=LIMITS,
    )
    assert out == ("memory,file" if kind == "none" else ""), out


MEMORY_PAIR = """
    import subprocess, sys
    child = "import time; block = b'x' * {each}; time.sleep(1.5)"  # written, so its pages are the process's
    children = [subprocess.Popen([sys.executable, "-I", "-S", "-c", child]) for _ in range(2)]
    print(sorted(c.wait() for c in children))
"""


@needs_bwrap
@pytest.mark.parametrize("cgroups", [True, False])
def test_an_episodes_processes_share_one_memory_limit(cgroups):
    # Two processes each under the limit, together over it: a memory cgroup kills one; rlimits (per process) cannot.
    if cgroups and "memory" not in cgroup_limits():
        pytest.skip("no memory cgroup can be made here (no writable v1 hierarchy, no delegated v2 `memory`)")
    sandbox = BwrapSandbox(limits=SandboxLimits(memory_bytes=256 << 20, cpu_seconds=30), cgroups=cgroups)
    out = attack("bwrap", MEMORY_PAIR.format(each=160 << 20), sandbox=sandbox)
    assert sandbox.limited_by["memory"] == ("cgroup" if cgroups else "rlimit (per process)")
    assert out == ("[-9, 0]" if cgroups else "[0, 0]"), out


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_processes_are_limited(kind):
    if kind == "bwrap" and not processes_limited():  # (a container has its pids limit)
        pytest.skip("no pids cgroup can be created here and RLIMIT_NPROC does not bind root")
    out = attack(
        kind,
        """
        import subprocess
        children = []
        for _ in range(100):
            try:
                children.append(subprocess.Popen(["sleep", "30"]))
            except OSError:
                break
        print(len(children))
        """,
        limits=LIMITS,
    )
    assert (int(out) == 100) == (kind == "none"), out
    if kind != "none":
        assert int(out) < 32


# --- the interface ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_files_in_commands_and_the_end_state_read_back(kind):
    sandbox = create_sandbox(kind)
    try:
        sandbox.write_files({"src/calc.py": "def add(a, b):\n    return a - b\n"})
        env = {"PATH": "/usr/bin:/bin", "HOME": str(sandbox.home)}
        fix = "import pathlib; p = pathlib.Path('src/calc.py'); p.write_text(p.read_text().replace('-', '+'))"
        result = asyncio.run(sandbox.run([PYTHON, "-I", "-S", "-c", fix], env, timeout=60))
        assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
        os.symlink("/etc/passwd", sandbox.workspace / "leak")
        assert sandbox.read_file("src/calc.py") == b"def add(a, b):\n    return a + b\n"
        assert sandbox.read_files() == {"src/calc.py": "def add(a, b):\n    return a + b\n"}  # links are not followed
        with pytest.raises(ValueError, match="outside the workspace"):
            sandbox.read_file("leak")
        with pytest.raises(ValueError, match="relative path"):
            sandbox.read_file("../home/x")

        # The checker's side: the same sandbox reopened from its spec (as kept in the episode's result), its tests run
        # there after the agent's processes are gone.
        checker = open_sandbox(json.loads(json.dumps(sandbox.spec())))
        test = "import sys; sys.path.insert(0, 'src'); import calc; print(calc.add(2, 3))"
        result = asyncio.run(checker.run([PYTHON, "-I", "-S", "-c", test], env, timeout=60))
        assert (result.exit_code, result.stdout) == (0, "5\n")
    finally:
        sandbox.destroy()
    assert not sandbox.workspace.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_command_past_its_deadline_is_killed_with_its_tree(kind):
    marker = f"4{os.getpid() % 1000}.{time.monotonic_ns() % 10**6:06d}"
    sandbox = create_sandbox(kind)
    command = ["/bin/sh", "-c", f"sleep {marker} & sleep {marker}"]
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(sandbox.run(command, {"PATH": "/usr/bin:/bin"}, timeout=1.0))
        time.sleep(0.3)
        assert alive_with(marker) == []
    finally:
        sandbox.destroy()


def test_the_setting_says_what_it_picks(monkeypatch):
    monkeypatch.delenv("TRL_AGENTIC_SANDBOX", raising=False)
    with pytest.raises(ValueError, match=r"sandbox='podman': use one of \['auto', 'bwrap', 'docker', 'none'\]"):
        resolve_kind("podman")
    assert resolve_kind("none") == "none"
    import trl_agentic.sandbox.bwrap as bwrap

    monkeypatch.setattr(bwrap, "bwrap_unavailable", lambda: "bubblewrap (`bwrap`) is not installed")
    with pytest.raises(ValueError) as error:
        resolve_kind("auto")
    assert str(error.value).startswith("No local sandbox for the agent's commands: bubblewrap (`bwrap`) is not")
    assert "`apt-get install bubblewrap`" in str(error.value) and "sandbox='none'" in str(error.value)
    monkeypatch.setattr(bwrap, "bwrap_unavailable", lambda: None)
    assert resolve_kind("auto") == resolve_kind(None) == "bwrap"
    monkeypatch.setenv("TRL_AGENTIC_SANDBOX", "none")  # a machine's explicit opt-in
    assert resolve_kind("auto") == "none" and resolve_kind("bwrap") == "bwrap"
    monkeypatch.setenv("TRL_AGENTIC_SANDBOX", "chroot")
    with pytest.raises(ValueError, match=r"\$TRL_AGENTIC_SANDBOX='chroot': use one of \['bwrap', 'docker', 'none'\]"):
        resolve_kind("auto")


def test_unsandboxed_runs_warn_once(monkeypatch):
    import trl_agentic.sandbox.base as base

    monkeypatch.setattr(base, "_warned_unsandboxed", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            NoSandbox().destroy()
    assert [str(w.message)[:50] for w in caught] == ["sandbox='none': agent commands run unsandboxed, as"]


@needs_bwrap
def test_the_bwrap_command_line_binds_only_what_it_names(tmp_path):
    sandbox = BwrapSandbox(binds=[str(tmp_path / "agent.py")])
    try:
        argv = sandbox.command(["true"])
        binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
        writable = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
        assert writable == [str(sandbox.workspace), str(sandbox.home)]
        assert "/" not in binds and os.path.expanduser("~") not in binds and os.getcwd() not in binds
        assert "--unshare-net" in argv and "--unshare-pid" in argv and "--die-with-parent" in argv
    finally:
        sandbox.destroy()


def test_the_container_backend_says_what_it_needs():
    with pytest.raises(ValueError, match="sandbox='docker' needs an image"):
        create_sandbox("docker")
    if DOCKER_MISSING is not None:
        with pytest.raises(RuntimeError, match="sandbox='docker': "):
            create_sandbox("docker", image=DOCKER_IMAGE)


OPENAI_AGENT = """
import json, os, openai
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "Hi."}])
print(json.dumps({"answer": reply.choices[0].message.content, "base_url": os.environ["OPENAI_BASE_URL"]}))
"""


@needs_bwrap
@pytest.mark.parametrize("forwarder", FORWARDERS)
def test_the_endpoint_is_reached_from_inside_by_the_official_client(start_server, tmp_path, forwarder):
    from conftest import ScriptedEngine
    from trl_agentic.rollout.agents import CommandAgent
    from trl_agentic.rollout.runner import run_episodes, run_rollout
    from trl_agentic.tiny_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("qwen2_5")
    server = start_server(ScriptedEngine(tokenizer, lambda prompt: "Fine."), tokenizer)
    script = tmp_path / "agent.py"
    script.write_text(OPENAI_AGENT)

    def sandbox(prefix, binds, limits, image):  # a factory: the bubblewrap backend with this forwarder
        return BwrapSandbox(prefix=prefix, binds=binds, limits=limits, forwarder=forwarder)

    agent = CommandAgent(f"{sys.executable} {script}", sandbox=sandbox)
    (episode,) = run_rollout(run_episodes(server, agent, [{"prompt": "p"}], timeout=60))
    assert episode.status == "ok", (episode.error, episode.metadata)
    assert episode.result["result"] == {"answer": "Fine.", "base_url": server.base_url}
    (turn,) = episode.turns
    assert tokenizer.decode(turn.completion_ids, skip_special_tokens=True) == "Fine."
    assert [m["content"] for m in episode.messages] == ["Hi.", "Fine."]


def test_groups_left_behind_by_a_killed_process_are_removed_by_the_next():
    made = make_cgroups({"pids": 100})
    if not made.groups:
        pytest.skip("no pids cgroup can be made here")
    base = made.groups[0].parent
    release(made.groups[0])
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has ended
    now, sleeper = int(time.time()), subprocess.Popen(["sleep", "30"])
    names = {
        "stale": f"trl-agentic-{gone.pid}-{now - 3600}-0000aaaa",  # removed: empty, old, its maker gone
        "recent": f"trl-agentic-{gone.pid}-{now}-0000bbbb",  # kept: its maker may be in another PID namespace
        "live": f"trl-agentic-{os.getpid()}-{now - 3600}-0000cccc",  # kept: its maker runs
        "busy": f"trl-agentic-{gone.pid}-{now - 3600}-0000dddd",  # kept: a process is in it
        "foreign": "trl-agentic-0123456789ab",  # kept: not named as this module names groups
    }
    groups = {key: base / name for key, name in names.items()}
    try:
        for group in groups.values():
            group.mkdir()
        (groups["busy"] / "cgroup.procs").write_text(str(sleeper.pid))
        assert sweep_stale(base) == [groups["stale"]]
        assert [key for key, group in groups.items() if group.exists()] == ["recent", "live", "busy", "foreign"]
    finally:
        sleeper.kill()
        sleeper.wait()
        for group in groups.values():
            for _ in range(50):  # the killed sleeper leaves its group within moments
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


@needs_bwrap
def test_inside_root_gives_every_episode_the_same_paths_and_a_checker_reopens_it_there():
    """`inside_root`: two episodes' commands see their workspace and home at the same paths (what a harness that
    writes its working directory into its prompt needs to replay), each writing its own host directory; a checker's
    sandbox, reopened from the spec, sees the workspace there too. Without it each sees its own path."""
    code = "import os; open('seen.txt', 'w').write(os.getcwd() + ' ' + os.environ['HOME']); print(os.getcwd())"
    seen, sandboxes = [], [BwrapSandbox(inside_root="/tmp/trl-agentic-test") for _ in range(2)]
    try:
        for sandbox in sandboxes:
            env = {"PATH": "/usr/bin:/bin", "HOME": sandbox.inside(sandbox.home)}
            result = asyncio.run(sandbox.run([PYTHON, "-I", "-S", "-c", code], env, timeout=60))
            assert result.exit_code == 0, result
            seen.append(sandbox.read_file("seen.txt").decode())
        assert seen == ["/tmp/trl-agentic-test/work /tmp/trl-agentic-test/home"] * 2
        assert sandboxes[0].workspace != sandboxes[1].workspace
        assert sandboxes[0].inside(f"{sandboxes[0].home}/.config") == "/tmp/trl-agentic-test/home/.config"
        assert sandboxes[0].inside(f"{sandboxes[1].home}") == str(sandboxes[1].home)  # not this episode's: as is
        assert sandboxes[0].inside("--flag") == "--flag"
        spec = json.loads(json.dumps(sandboxes[0].spec()))
        assert spec["inside_root"] == "/tmp/trl-agentic-test"
        checker = open_sandbox(spec)
        pwd = asyncio.run(checker.run(["/bin/pwd"], {"PATH": "/usr/bin:/bin"}, timeout=60))
        assert pwd.stdout.strip() == "/tmp/trl-agentic-test/work"
    finally:
        for sandbox in sandboxes:
            sandbox.destroy()
    plain = BwrapSandbox()
    try:
        result = asyncio.run(plain.run([PYTHON, "-I", "-S", "-c", code], {"HOME": str(plain.home)}, timeout=60))
        assert result.stdout.strip() == str(plain.workspace) and plain.inside(plain.home) == str(plain.home)
    finally:
        plain.destroy()
    for bad in ("relative/path", "/usr/trl-agentic"):
        with pytest.raises(ValueError, match="inside_root="):
            BwrapSandbox(inside_root=bad)
