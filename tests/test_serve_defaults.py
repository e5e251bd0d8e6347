"""`kivi serve`'s defaults (issue 43, item 4): paged with prefix caching on CPU, static rows on CUDA
until the paged CUDA tests have passed on a GPU; the no-flag configuration fits its own budget and
starts; its start-up line says what it holds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kivi_cli.main import build_parser
from kivi_cli.serve import CHAT_TOKENS, DEFAULT_SEQUENCES, PAGED_ROWS, fp16_paged_sequences, plan_pages, \
    resolve_paging_defaults
from serve_fixtures import free_port


def serve_args(*argv):
    parser = build_parser()
    return parser.parse_args(["serve", *argv]), parser


@pytest.mark.parametrize("argv, device, paged, prefix", [
    ([], "cpu", True, True),
    ([], "cuda", False, False),
    (["--no-paged"], "cpu", False, False),
    (["--no-prefix-caching"], "cpu", True, False),
    (["--paged"], "cuda", True, True),
    (["--paged", "--no-prefix-caching"], "cuda:0", True, False),
])
def test_paging_defaults_by_device(argv, device, paged, prefix):
    args, _ = serve_args(*argv)
    resolve_paging_defaults(args, device)
    assert (args.paged, args.prefix_caching) == (paged, prefix)


@pytest.fixture(scope="module")
def embedded():
    from kivi_models.loading import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)[0]


def test_the_no_flag_pool_holds_the_rows_and_8_full_sequences(embedded):
    """The old default (the bytes of 8 static rows) could not hold 32 rows' KIVI windows: `kivi
    serve --paged` exited 2 with its own defaults."""
    from kivi_cli.args import kivi_config_from
    from kivi_models.generate import make_paged_cache, paged_bytes

    args, parser = serve_args()
    config = kivi_config_from(args, parser)
    rows, pages, nbytes = plan_pages(embedded, args, config, parser)
    cache = make_paged_cache(embedded, method=args.method, batch_size=1, max_seq_len=args.max_seq_len, num_pages=1,
                             kivi_config=config, device="meta")
    per_page, fixed = paged_bytes(embedded, method=args.method, batch_size=rows, max_seq_len=args.max_seq_len,
                                  kivi_config=config)
    assert rows == PAGED_ROWS and pages == DEFAULT_SEQUENCES * cache.pages_needed(args.max_seq_len)
    assert nbytes == fixed + pages * per_page


def test_fp16_paged_sequences_counts_16_token_pages_of_every_token(embedded):
    c = embedded.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    per_sequence = 512 * per_token  # 500 tokens in 32 pages of 16
    assert fp16_paged_sequences(embedded, 10 * per_sequence - 1, CHAT_TOKENS) == 9
    assert fp16_paged_sequences(embedded, 10 * per_sequence, CHAT_TOKENS) == 10


@pytest.mark.slow  # the embedded model in a process of its own (it inherits the suite's reference kernels,
# conftest.py: the warm-up compiles nothing here; tests/test_serve_warmup.py checks the compiled ones)
def test_kivi_serve_with_no_flags_starts_paged_with_prefix_caching_and_serves(tmp_path):
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "kivi"), "serve", "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.time() < deadline, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "kivi_cache_pages_used" in metrics and "kivi_prefixes_cached" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log_path.read_text()
    assert "paged: 32 rows, a pool of 512 pages" in text and "prefix caching in chunks of 64 tokens" in text, text
    assert "where an fp16 paged cache would hold" in text, text
