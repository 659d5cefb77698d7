"""The docs' walk-through, run as printed: the shell commands are read from the markdown, not copied here.

A user's fresh account: HOME is a new directory, no ``REWIND_*`` or ``PREFECT_*`` variable is set
(so REWIND_HOME is ``~/.rewind`` and Prefect's client home ``~/.prefect``). What a test changes is
said once, here: the port (free, not 4200, through Prefect's own ``PREFECT_SERVER_API_PORT``), the
Postgres database's name (one per test session), ``.venv/bin/`` (this interpreter's bin directory),
the Postgres server and user (the test session's), and quiet, local-only Prefect settings in the environment (no telemetry; faster polling).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.prefect_support import REPO, stop_group, wait_until
from tests.ui_support import Server

FENCED_BASH = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
LONG_RUNNING = re.compile(r"(^|/)rewind serve(r)?(\s|$)")  # a server: started, left running


def block_under(markdown: Path, heading: str) -> list[str]:
    """The commands of the first ``bash`` block after ``heading``: one per line, comments dropped."""
    text = markdown.read_text(encoding="utf-8")
    at = text.index(heading)
    match = FENCED_BASH.search(text, at)
    assert match is not None, f"no bash block under {heading!r} in {markdown.name}"
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in match.group(1).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def inline_command(markdown: Path, starts: str) -> str:
    """The first inline code span (`...`) that starts with ``starts``."""
    found = re.search(rf"`({re.escape(starts)}[^`]*)`", markdown.read_text(encoding="utf-8"))
    assert found is not None, f"no `{starts} ...` in {markdown.name}"
    return found.group(1)


@dataclass
class Shell:
    """One user's shell: the environment its `export`s build, the servers it left running."""

    home: Path
    port: int
    database: str
    env: dict[str, str] = field(default_factory=dict)
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def substitute(self, line: str) -> str:
        line = re.sub(r"(?<![\w/])\.venv/bin/", f"{Path(sys.executable).parent}/", line)
        line = line.replace("127.0.0.1:4200", f"127.0.0.1:{self.port}")
        # the docs' Postgres, as this test session reaches it (REWIND_TEST_PG_ADMIN), in a database of its own
        return re.sub(r"postgresql\+psycopg://[^\s/]+/rewind\b", lambda _: self.database_url, line)

    @property
    def database_url(self) -> str:
        from tests.conftest import ADMIN_URL

        base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
        return f"{base}/{self.database}"

    def type(
        self, line: str, cwd: Path | None = None, timeout_s: float = 240
    ) -> subprocess.CompletedProcess[str]:
        """Run one line as typed (after the substitutions above), in bash; ``export`` lines set the env."""
        line = self.substitute(line)
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            (self.env[name],) = shlex.split(value)
            return subprocess.CompletedProcess(line, 0, "", "")
        if LONG_RUNNING.search(line):
            self._start(line)
            return subprocess.CompletedProcess(line, 0, "", "")
        done = subprocess.run(["bash", "-c", line], cwd=cwd or self.home, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)  # fmt: skip
        assert done.returncode == 0, (
            f"{line!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
        return done

    def _start(self, line: str) -> None:
        log = self.home / f"{len(self.servers)}-{line.split()[-1]}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.home, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.servers.append(proc)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.home.glob("*.log")))

    def server(self) -> Server:
        """The `rewind server` this shell started, once its API answers (the credential it wrote)."""
        from rewind.flows import server_auth

        base = f"http://127.0.0.1:{self.port}"

        def healthy() -> bool:
            assert all(p.poll() is None for p in self.servers), self.logs()
            try:
                return httpx.get(f"{base}/api/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "the walk-through's rewind server")
        credential = server_auth.read(self.home / ".rewind" / "prefect-auth")
        return Server(self.servers[0], base, self.home / "0-server.log", credential)


@contextmanager
def fresh_shell(home: Path, port: int, database: str) -> Iterator[Shell]:
    """A new user's shell under ``home``; every server it starts is stopped (bounded) at the end."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "REWIND_"))}
    env.update({
        "HOME": str(home),
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # test traffic stays on this machine
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    })  # fmt: skip
    shell = Shell(home, port, database, env)
    with ExitStack() as stack:
        stack.callback(lambda: [stop_group(p) for p in reversed(shell.servers)])
        yield shell


README = REPO / "README.md"
ORCHESTRATION = REPO / "docs" / "orchestration.md"
