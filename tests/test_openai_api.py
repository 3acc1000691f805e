"""The OpenAI-compatible API of launch.rollout_server, driven by the real `openai` client, direct and through
the real sglang-router. References: /generate on the same server with the same sampling_seed, the in-process
engine on the same weights, and transformers' own tokenizer for the chat template."""

import json
import urllib.error
import urllib.request

import pytest

from launch.engines import openai_api
from launch.engines.base import Request, request_seed
from launch.engines.embedded import run_chunk
from launch.rollout_server import server_ops
from miles_fn import model, prng
from miles_fn.sampling import SamplingConfig
from tests.openai_fixtures import CFG, CHARS, TEMPLATE, router, save_checkpoint, server

openai = pytest.importorskip("openai")
pytest.importorskip("sglang_router")

SEED = 2**63 + 12345  # past 63 bits: the full 64-bit key travels


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """(checkpoint, two servers' URLs (the tokenizer from the checkpoint), the real router's URL over them)."""
    d = tmp_path_factory.mktemp("openai")
    ckpt = save_checkpoint(str(d / "ckpt"))
    procs = [server(ckpt, str(d / f"s{i}.log")) for i in range(2)]
    try:
        direct = [p.start() for p in procs]
        rproc, r = router(direct, str(d / "router.log"))
        procs.append(rproc)
        yield ckpt, direct, r.url
    finally:
        for p in procs:
            p.stop()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(url: str, ids: list[int], seed: int, n: int, stop=(2,), temperature=1.0, top_p=1.0):
    code, reply = post(url, "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "sampling_seed": seed, "temperature": temperature, "top_p": top_p,
        "stop_token_ids": list(stop)}})
    assert code == 200, reply
    pairs = reply[0]["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def test_completions_with_a_seed_are_generate_with_that_sampling_seed(urls):
    ckpt, (a, b), via_router = urls
    ids = [CHARS.bos_id, *CHARS.encode("12+3=")]
    want = generate(a, ids, SEED, 8, top_p=0.9)
    # The in-process engine on the same weights gives the same bits (an independent reference for /generate).
    local = run_chunk(model.init_params(CFG, prng.key(0), 0.3), CFG, [Request(0, ids, SEED)],
                      SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=8, stop_token_ids=(2,)), 0,
                      server_ops(False, 0, 0))[0]
    assert (local.tokens, local.logprobs) == want
    for url in (a, b):
        for kw in ({"prompt": ids}, {"prompt": "", "extra_body": {"input_ids": ids}}):  # ids, and the extension
            r = client(url).completions.create(model="miles-fn", max_tokens=8, seed=SEED, top_p=0.9, logprobs=0, **kw)
            (c,) = r.choices
            assert (c.token_ids, c.logprobs.token_logprobs) == want
            assert c.prompt_token_ids == ids and c.text == CHARS.decode(want[0])
            assert c.logprobs.tokens == [CHARS.vocab[t] for t in want[0]]
            assert c.finish_reason == ("stop" if want[0][-1] == 2 else "length")
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want[0])
            assert r.usage.total_tokens == len(ids) + len(want[0]) and c.meta_info["served_by"] == url
    r = client(a).completions.create(model="m", prompt="12+3=", max_tokens=8, seed=SEED, top_p=0.9)
    assert r.choices[0].prompt_token_ids == CHARS.encode("12+3=")  # the tokenizer's ids, as the trainer sees them
    assert r.choices[0].token_ids == generate(a, CHARS.encode("12+3="), SEED, 8, top_p=0.9)[0]


def test_n_choices_use_the_seed_then_its_fold_ins_and_stop_strings_cut_a_prefix(urls):
    _, (a, _), _ = urls
    ids = [1, 4, 5]
    r = client(a).completions.create(model="m", prompt=ids, max_tokens=10, seed=7, n=3, temperature=1.0)
    seeds = [7, request_seed(prng.key(7), 1), request_seed(prng.key(7), 2)]
    for c, s in zip(r.choices, seeds, strict=True):
        assert c.token_ids == generate(a, ids, s, 10)[0]
    full, lps = generate(a, ids, 7, 10)
    stop = CHARS.vocab[full[2]]  # a character the reply holds at position 2 (maybe earlier too)
    cut = next(k for k in range(len(full)) if CHARS.vocab[full[k]] == stop) + 1
    (c,) = client(a).completions.create(model="m", prompt=ids, max_tokens=10, seed=7, stop=[stop],
                                        logprobs=0).choices
    assert c.token_ids == full[:cut] and c.logprobs.token_logprobs == lps[:cut]
    assert c.finish_reason == "stop" and c.matched_stop == stop and c.text == CHARS.decode(full[: cut - 1])


def test_chat_goes_through_the_tokenizers_template_direct_and_through_the_router(urls):
    from transformers import AutoTokenizer

    ckpt, (a, _), via_router = urls
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+3"}]
    want_prompt = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(msgs, add_generation_prompt=True,
                                                                          tokenize=True)
    want_prompt = list(want_prompt["input_ids"] if hasattr(want_prompt, "keys") else want_prompt)
    assert CHARS.decode(want_prompt) == "s:add,u:12+3,a:"  # TEMPLATE, applied by transformers
    assert TEMPLATE.startswith("{% for m in messages %}")
    tokens, lps = generate(a, want_prompt, 99, 6)
    for url in (a, via_router):
        r = client(url).chat.completions.create(model="m", messages=msgs, max_tokens=6, seed=99, logprobs=True)
        (c,) = r.choices
        assert c.prompt_token_ids == want_prompt and c.token_ids == tokens
        assert [x.logprob for x in c.logprobs.content] == lps
        assert [x.token for x in c.logprobs.content] == [CHARS.vocab[t] for t in tokens]
        assert c.message.role == "assistant" and c.message.content == CHARS.decode(tokens)
        assert r.object == "chat.completion" and r.usage.prompt_tokens == len(want_prompt)
    assert [m.id for m in client(a).models.list().data] == ["miles-fn"]


def test_the_router_refuses_id_prompts_and_passes_input_ids(urls):
    """sglang-router 0.3.2 parses /v1/completions into its own schema: a prompt must be text (ids: 4xx from the
    router itself), unknown fields pass through, so ids go as the input_ids extension."""
    _, (a, _), via_router = urls
    code, text = post(via_router, "/v1/completions", {"model": "m", "prompt": [1, 4, 5], "max_tokens": 3})
    assert code in (400, 422) and "prompt" in text
    code, text = post(via_router, "/v1/completions", {"model": "m", "prompt": "", "input_ids": [1, 4, 5],
                                                      "seed": SEED, "max_tokens": 3})
    assert code in (400, 422) and "seed" in text  # the router's seed is an i64
    want = generate(a, [1, 4, 5], SEED, 4)
    assert openai_api.signed_seed(SEED) < 0
    for _ in range(2):  # round robin: both servers
        r = client(via_router).completions.create(model="m", prompt="", max_tokens=4, logprobs=0,
                                                  seed=openai_api.signed_seed(SEED),
                                                  extra_body={"input_ids": [1, 4, 5]})
        assert (r.choices[0].token_ids, r.choices[0].logprobs.token_logprobs) == want


@pytest.mark.parametrize("body, field", [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 95}, "max_tokens"),  # 2 + 95 > the 96 positions
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt": [1, 2], "seed": -(2**63) - 1}, "seed"),
    ({"prompt": [1, 2], "seed": 2**64}, "seed"),
    ({"prompt": [1, 2], "seed": True}, "seed"),
    ({"prompt": [1, 99]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2], "logprobs": 3}, "logprobs"),
    ({"prompt": [1, 2], "stop": [""]}, "stop"),
    ({"prompt": [1, 2], "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": [1, 2], "stream": True}, "stream"),
    ({"prompt": [1, 2], "n": 0}, "n"),
    ({"prompt": [1, 2], "banana": 1}, "banana"),
    ({"prompt": "x", "input_ids": [1, 2]}, "input_ids"),
    ({"prompt": "", "input_ids": [[1, 2], [1, -4]]}, "input_ids[1][1]"),
])
def test_bad_completions_are_400s_naming_the_field(urls, body, field):
    _, (a, _), _ = urls
    with pytest.raises(openai.BadRequestError) as e:
        client(a).completions.create(model="m", **{"prompt": body.pop("prompt")}, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["message"].startswith(field + ":"), e.value
    assert e.value.body["param"] == field and field + ":" in str(e.value)  # what the client shows


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
     "max_completion_tokens"),
])
def test_bad_chat_requests_are_400s_naming_the_field(body, field):
    codec = openai_api.load_codec("char")  # pure parsing: no server needed
    with pytest.raises(ValueError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]") + ":"):
        codec_chat = openai_api.Codec(codec.encode, codec.decode, codec.token, lambda m: codec.encode("x"), 2)
        openai_api.chat_request(body, codec_chat, CFG.vocab_size, CFG.max_position_embeddings)


def test_text_needs_a_tokenizer_and_chat_a_template():
    with pytest.raises(ValueError, match="^prompt: this server has no tokenizer"):
        openai_api.completion_request({"prompt": "hi"}, openai_api.NO_TOKENIZER, 48, 96)
    with pytest.raises(ValueError, match="^messages: this server's tokenizer has no chat template"):
        openai_api.chat_request({"messages": [{"role": "user", "content": "x"}]}, openai_api.load_codec("char"), 48, 96)
    gen, plan = openai_api.completion_request({"prompt": [3, 4], "max_tokens": 2}, openai_api.NO_TOKENIZER, 48, 96)
    assert gen["sampling_params"][0]["stop_token_ids"] == []  # no tokenizer, no EOS known: only stop_token_ids
    reply = [{"meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]],
                            "weight_version": "3"}}]
    out = openai_api.response(dataclass_replace(plan, logprobs=True), reply, openai_api.NO_TOKENIZER, "x", 0)
    assert out["choices"][0]["logprobs"]["tokens"] == ["token_id:7"] and out["choices"][0]["text"] == ""
    assert out["choices"][0]["meta_info"] == {"weight_version": "3"}


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)
