"""`optkit serve small` as a real process, driven by the official `openai` client."""

import asyncio
import socket
import time

import pytest

from tests.metrics_text import metric_samples
from tests.serve_process import httpx, serving

pytestmark = pytest.mark.slow

KEY = "sk-optkit-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's base URL; one process for the whole module, stopped at the end."""
    args = ["small", "--api-key", KEY, "--max-num-seqs", "64"]
    with serving(tmp_path_factory.mktemp("serve"), *args) as (base, log):
        assert f"serving small on {base}" in log.read_text()
        yield base


def client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(base: str) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    return metric_samples(httpx.get(f"{base}/metrics", headers=headers, timeout=10).text)


def test_completion(server):
    response = client(server).completions.create(model="small", prompt="Once upon a time", max_tokens=8, temperature=0)
    [choice] = response.choices
    assert response.model == "small" and isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "stop" or response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens > 0


def test_chat_completion(server):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    response = client(server).chat.completions.create(model="small", messages=messages, max_tokens=8, temperature=0)
    [choice] = response.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "stop" or response.usage.completion_tokens == 8


def test_streaming_completion(server):
    openai_client = client(server)
    request = dict(model="small", prompt="The quick brown fox", max_tokens=12, temperature=0)
    whole = openai_client.completions.create(**request).choices[0].text
    chunks = list(openai_client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12


def test_client_errors(server):
    import openai

    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client(server).completions.create(model="small", prompt="hi", n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client(server).models.list().data] == ["small"]


def test_200_concurrent_requests(server):
    import openai

    prompts = ["Once upon a time", "def fibonacci(n):", "The capital of France", "import numpy as np"]
    max_tokens = 6

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300) as aclient:
            calls = [
                aclient.completions.create(model="small", prompt=prompts[i % 4], max_tokens=max_tokens, temperature=0)
                for i in range(200)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(run())
    texts: dict[str, set[str]] = {}
    for i, response in enumerate(responses):
        [choice] = response.choices
        assert choice.finish_reason == "stop" or response.usage.completion_tokens == max_tokens
        texts.setdefault(prompts[i % 4], set()).add(choice.text)
    assert all(len(t) == 1 for t in texts.values()), texts  # greedy: identical prompts, identical texts
    alone = client(server).completions.create(model="small", prompt=prompts[0], max_tokens=max_tokens, temperature=0)
    assert texts[prompts[0]] == {alone.choices[0].text}


def test_disconnect_mid_stream_frees_the_request(server):
    generated_before = metrics(server)["optkit:generation_tokens_total"]
    body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        received = [line for line, _ in zip(events, range(4), strict=False) if line.startswith("data: ")]
        assert received
    deadline = time.monotonic() + 30
    while True:
        samples = metrics(server)
        idle = samples["optkit:num_requests_running"] == 0 and samples["optkit:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert samples["optkit:num_requests_running"] == 0
    assert samples["optkit:kv_cache_usage_perc"] == 0
    assert samples['optkit:request_success_total{finish_reason="abort"}'] >= 1
    assert samples["optkit:generation_tokens_total"] - generated_before < 400  # it stopped early


def test_port_in_use_is_a_one_line_error(run_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run_cli("serve", "small", "--port", taken.getsockname()[1])
    assert code == 2
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "pick another --port" in err
    assert len(err.strip().splitlines()) == 1
