"""tools/gpu_serve.py's client against a stub OpenAI-style server (the server itself needs a GPU)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import gpu_serve


class _Stub(BaseHTTPRequestHandler):
    """Answers like vLLM: ``max_tokens`` tokens, except for prompts of a special shape."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        if body["prompt"][0] == 7:  # a server error
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        if body["prompt"][0] == 8:  # a short answer
            n -= 1
        data = {"choices": [{"token_ids": list(range(n))}], "usage": {"completion_tokens": n}}
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_concurrent_requests_are_checked(stub: str) -> None:
    prompts = [[1, 2, 3]] * 10 + [[7, 1]] + [[8, 1]]
    answers, wall = gpu_serve.fire(stub, "m", prompts, 16, 4, 10)
    assert wall > 0
    assert [a.ok for a in answers] == [True] * 10 + [False, False]
    assert answers[0].completion_tokens == 16 and answers[0].token_ids == 16
    assert answers[10].status == 500 and "boom" in answers[10].error
    assert answers[11].status == 200 and "completion_tokens=15" in answers[11].error


def test_unreachable_server_is_an_error() -> None:
    answer = gpu_serve.one_request("http://127.0.0.1:9", "m", [1], 4, 2)
    assert not answer.ok and answer.status == 0 and answer.error


def test_prompt_budget_is_validated() -> None:
    with pytest.raises(SystemExit):
        gpu_serve.main(["--max-prompt", "4000", "--max-tokens", "200", "--max-model-len", "4096"])


def test_jit_compiles_are_read_from_the_server_log() -> None:
    log = (
        "(EngineCore pid=1) INFO ... Kernel JIT monitor activated\n"
        "(EngineCore pid=1) WARNING 11-30 06:37:50 [jit_monitor.py:103] Triton kernel JIT "
        "compilation during inference: _rotate_rows_kernel. This causes a latency spike\n"
        "(EngineCore pid=1) WARNING 11-30 06:38:02 [jit_monitor.py:103] Triton kernel JIT "
        "compilation during inference: decode_v4_kernel. This causes a latency spike\n"
    )
    assert gpu_serve.common.jit_compiles(log) == ["_rotate_rows_kernel", "decode_v4_kernel"]
    assert gpu_serve.common.jit_compiles("no warnings") == []
    row = {"kv_cache_dtype": "x", "status": "ok", "jit_compiles_while_serving": []}
    assert gpu_serve.table([row]).splitlines()[-1].endswith("| none |")
