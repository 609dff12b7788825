"""A real server (uvicorn in a subprocess on a free loopback port) over the tiny preset, with a small
word-level tokenizer and a chat template that the fixture builds with ``tokenizers``.

The server runs the ops' PyTorch references (TRITON_INTERPRET unset in its environment): these
tests exercise HTTP, the engine thread and the request bookkeeping, not kernels; the offline
engine they compare with runs the same references (``reference_ops`` fixture).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

WORDS = [f"w{i}" for i in range(248)]
SPECIAL = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
API_KEY = "sk-test"


def build_tokenizer(directory) -> None:
    """A 253-token word-level tokenizer (ids within the tiny preset's 256) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "unk_token": "<unk>"}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], tmp_path, model: str = "mamba2-tiny"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastmamba.serve", "--model", model, "--dtype", "fp32", "--device", "cpu",
             "--port", str(self.port), "--log-level", "warning", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:  # never leave a server behind that did not come up
            self.proc.kill()
            self.proc.wait()
            raise

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-4000:]

    def metric(self, name: str) -> float:
        import httpx

        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    s = Server(["--tokenizer", str(tokenizer_dir), "--api-key", API_KEY, "--max-batch", "64",
                "--max-waiting", "256", "--max-model-len", "64"], tmp_path_factory.mktemp("log"))
    yield s
    s.terminate()


@pytest.fixture
def reference_ops(monkeypatch):
    """Run fastmamba's ops as their PyTorch references in this process (as the server does)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
