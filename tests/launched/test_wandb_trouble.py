"""W&B trouble never stops training: on real runs it falls back to offline, or off, and says so once. A failing
log call: tests/unit/test_wandb_trouble.py."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from tests.helpers import FAST, launch, metrics

_ONLINE = ["strategy=single", *FAST, "logger=wandb", "logger.mode=online"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Rejects(http.server.BaseHTTPRequestHandler):
    """A W&B server that answers every request as a server does for a bad API key."""

    def _deny(self) -> None:
        body = b'{"errors":[{"message":"user is not logged in"}]}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _deny

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def rejecting_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rejects)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _online(tmp_path: Path, base_url: str):
    return launch(_ONLINE, run_dir=tmp_path, extra_env={
        "WANDB_MODE": "", "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": base_url,
    })


@pytest.mark.beside
@pytest.mark.parametrize("server", ["unreachable", "rejects the key"])
def test_online_trouble_falls_back_to_offline_and_says_so_once(server, rejecting_server, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}" if server == "unreachable" else rejecting_server
    proc = _online(tmp_path, url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "W&B: cannot log online" in ln]
    assert len(said) == 1 and "logging offline instead" in said[0], proc.stderr[-3000:]
    assert ("Connection refused" if server == "unreachable" else "not logged in") in said[0]
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert sorted({r["step"] for r in metrics(tmp_path)}) == [1, 2, 3, 4, 5]


@pytest.mark.beside
def test_a_directory_that_refuses_the_files_turns_wandb_off(tmp_path):
    (tmp_path / "wandb").write_text("a file where W&B wants its directory")
    proc = launch(["strategy=single", *FAST, "logger=wandb"], run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "W&B is off for the rest of this run" in ln]
    assert len(said) == 1, proc.stderr[-3000:]
    assert sorted({r["step"] for r in metrics(tmp_path)}) == [1, 2, 3, 4, 5]
