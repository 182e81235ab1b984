"""`torchrun --nproc-per-node 2 -m paratron serve --inference-dynamic-batching`: the paged engine served at TP = 2
(gloo) answers concurrent greedy completions with the tokens of the same server at TP = 1; with speculative
decoding from a checkpoint's MTP depths (`--num-speculative-tokens`) at TP = 2, with the plain server's at TP = 1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from tests.dist import free_port  # noqa: E402
from tests.servers import wait_until_healthy  # noqa: E402
from tests.tiny_generation import make_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGED = ["--inference-dynamic-batching", "--inference-dynamic-batching-block-size", "4",
         "--inference-dynamic-batching-num-blocks", "64", "--inference-dynamic-batching-max-tokens", "16",
         "--enable-chunked-prefill"]
PROMPTS = ["hello world", "the quick brown fox jumps", "hello there", "over the lazy dog and the quick"]


def _serve(ckpt: Path, port: int, nproc: int, extra: tuple = ()) -> subprocess.Popen:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.Popen(launch + ["-m", "paratron", "serve", "--load", str(ckpt), "--port", str(port), *PAGED,
                                      *extra],
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return wait_until_healthy(proc, port, 180, kill=lambda: os.killpg(proc.pid, signal.SIGKILL))


def _complete(port: int, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _answers(ckpt: Path, nproc: int, extra: tuple = (), prompts: list = PROMPTS) -> tuple[list[str], str]:
    port = free_port()
    proc = _serve(ckpt, port, nproc, extra)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: they join the running steps
            texts = list(pool.map(lambda p: _complete(port, p), prompts))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # the server exited by itself: its output says why
            pass
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
    return texts, out


def test_paged_server_tp2_answers_as_tp1(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path)
    one, _ = _answers(ckpt, 1)
    two, log = _answers(ckpt, 2)
    assert "paged engine: 63 blocks of 4 tokens" in log, log
    assert two == one and all(one), (one, two)


@pytest.mark.slow  # (16 s; the plain TP2 server stays in CI)
def test_paged_speculative_server_tp2_answers_as_plain_tp1(tmp_path):
    """A checkpoint trained with one MTP depth (the tiny preset, token-id prompts), served with drafts at TP = 2:
    the greedy texts of the plain server at TP = 1, and the start-up line says it drafts."""
    from paratron.config import parse_args
    from paratron.train.loop import pretrain
    pretrain(parse_args(["--config", "tiny", "--train-iters", "1", "--eval-iters", "0", "--mtp-num-layers", "1",
                         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                         "--global-batch-size", "1", "--save", str(tmp_path)]))
    prompts = ["7 8 9", "1 2 3 4 5 6", "40 41", "9 9 9 9 9 9 9 9 9"]
    one, _ = _answers(tmp_path, 1, prompts=prompts)
    two, log = _answers(tmp_path, 2, ("--num-speculative-tokens", "1"), prompts)
    assert "speculative decoding: up to 1 drafts" in log, log
    assert two == one and all(one), (one, two)
