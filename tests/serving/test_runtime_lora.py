"""LoRA adapters loaded and unloaded while the server runs (/v1/load_lora_adapter,
/v1/unload_lora_adapter): each adapter's greedy text equals stock PEFT `generate` with it,
the base model's equals the plain model's, an unload waits for the adapter's requests in
flight, its prefix-cache blocks are dropped (a new adapter of the same name never reuses
them), bad loads are 400s, and the endpoints are off unless enabled."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model

from hf_paged import LLMEngine, SamplingParams
from hf_paged.errors import InvalidRequestError, ModelChangedError, UnsupportedModelError
from hf_paged.server import build_app
from conftest import make_model, make_tokenizer
from test_server import ServerThread

PROMPT = [5, 9, 14, 3, 22, 40, 7, 61, 33, 12, 18, 4, 27]
TOKENIZER = make_tokenizer()


def save_adapter(folder, seed, **options):
    model = make_model("llama_gqa")
    torch.manual_seed(seed)  # (after make_model, which seeds its own weights)
    peft = get_peft_model(model, LoraConfig(**{
        "task_type": TaskType.CAUSAL_LM, "r": 4, "lora_alpha": 1,
        "target_modules": "all-linear", "init_lora_weights": False, **options}))
    if "modules_to_save" in options:  # a head of its own, unlike the base model's
        with torch.no_grad():
            peft.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1)
    peft.save_pretrained(folder)  # the default adapter's files in `folder`
    return str(folder)


def stock(prompt, folder=None, n=6):
    """The greedy text of the plain model, or of it with the adapter in `folder`."""
    model = make_model("llama_gqa")
    if folder is not None:
        model = PeftModel.from_pretrained(model, folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return TOKENIZER.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    made = {name: save_adapter(root / name, seed) for name, seed in (("a", 1), ("b", 2))}
    made["head"] = save_adapter(root / "head", 3, target_modules=["q_proj"],
                                modules_to_save=["lm_head"])
    made["dora"] = save_adapter(root / "dora", 4, use_dora=True)
    return made


@pytest.fixture()
def served():
    app = build_app(make_model("llama_gqa"), TOKENIZER, served_model_name="base",
                    block_size=4, num_blocks=256, max_num_seqs=8, runtime_lora=True)
    with ServerThread(app) as server:
        server.http = httpx.Client(base_url=server.url, timeout=120)
        yield server


def text_of(server, model, n=6):
    r = server.http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                  "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_load_serve_unload_and_reload(served, adapters):
    http = served.http
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                    "lora_path": adapters["a"]}).status_code == 200
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "b",
                                                    "lora_path": adapters["b"]}).status_code == 200
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base", "a", "b"]
    one = http.get("/v1/models/a").json()  # OpenAI's "retrieve model"
    assert (one["id"], one["object"], one["parent"]) == ("a", "model", "base")
    missing = http.get("/v1/models/c")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert len({stock(PROMPT), stock(PROMPT, adapters["a"]), stock(PROMPT, adapters["b"])}) == 3
    assert text_of(served, "a") == stock(PROMPT, adapters["a"])
    assert text_of(served, "b") == stock(PROMPT, adapters["b"])
    assert text_of(served, "base") == stock(PROMPT)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json={"model": "a", "prompt": PROMPT}).status_code == 404
    # A new "a" with b's weights: the old a's cached prompt blocks must not be found.
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                    "lora_path": adapters["b"]}).status_code == 200
    assert text_of(served, "a") == stock(PROMPT, adapters["b"])
    for name in ("a", "b"):
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert text_of(served, "base") == stock(PROMPT)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base"]


def test_unload_waits_for_requests_in_flight(served, adapters):
    http = served.http
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "b",
                                                    "lora_path": adapters["b"]}).status_code == 200

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            long = asyncio.create_task(client.post("/v1/completions", json={
                "model": "b", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}))
            await asyncio.sleep(0.3)
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
            return await long, unload

    finished, unload = asyncio.run(main())
    assert unload.status_code == 200
    choice = finished.json()["choices"][0]
    assert choice["finish_reason"] == "length" and finished.json()["usage"][
        "completion_tokens"] == 40
    assert http.post("/v1/completions", json={"model": "b", "prompt": PROMPT}).status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"lora_name": "x", "lora_path": "/nonexistent/folder"}, "lora_path"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": ""}, "lora_name"),
    ({"lora_name": "__base__", "lora_path": "."}, "lora_name"),
    ({"lora_name": "base", "lora_path": "."}, "lora_name"),  # the served model's name
])
def test_bad_loads_are_400s(served, body, param):
    r = served.http.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "never_loaded"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert text_of(served, "base") == stock(PROMPT)


@pytest.mark.parametrize("config", ["{not json", "[]", '{"peft_type": "NOPE"}'])
def test_an_adapter_config_peft_cannot_read_is_a_400(served, tmp_path, config):
    """PEFT's own parse of adapter_config.json failing (not JSON, not an object, an unknown
    type) was a 500."""
    (tmp_path / "adapter_config.json").write_text(config)
    r = served.http.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                        "lora_path": str(tmp_path)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json PEFT cannot read" in r.json()["error"]["message"]
    assert text_of(served, "base") == stock(PROMPT)


def test_a_model_with_adapters_transformers_loaded_is_served_as_it_runs(adapters):
    """Requests name the served model (BASE to the engine): it runs with the adapter its
    own `load_adapter` put in; a runtime load beside it is a 400 that says why."""
    model = make_model("llama_gqa")
    model.load_adapter(adapters["a"], adapter_name="a")
    app = build_app(model, TOKENIZER, served_model_name="m", block_size=4, num_blocks=128,
                    runtime_lora=True)
    with ServerThread(app) as server:
        server.http = httpx.Client(base_url=server.url, timeout=120)
        assert text_of(server, "m") == stock(PROMPT, adapters["a"])
        r = server.http.post("/v1/load_lora_adapter",
                             json={"lora_name": "b", "lora_path": adapters["b"]})
        assert r.status_code == 400 and "peft.PeftModel" in r.json()["error"]["message"]
        assert text_of(server, "m") == stock(PROMPT, adapters["a"])


def test_runtime_lora_is_off_by_default(adapters):
    app = build_app(make_model("llama_gqa"), None, served_model_name="base", block_size=4,
                    num_blocks=64)
    with ServerThread(app) as server:
        r = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": "a", "lora_path": adapters["a"]}, timeout=30)
        assert r.status_code == 404
        assert "--enable-runtime-lora" in r.json()["error"]["message"]


def test_engine_refuses_under_compile(adapters):
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=64, compile="eager")
    with pytest.raises(InvalidRequestError, match="compile"):
        engine.lora.load("a", adapters["a"])
    assert engine.adapters == []


def test_requests_without_an_adapter_hold_the_active_one(adapters):
    """A PEFT model given to the engine runs its active adapter for requests that name
    none: their prefix-cache blocks are that adapter's, dropped when it is unloaded (the same
    prompt then runs the base model and finds none), and an unload waits for them."""
    long_prompt = list(range(3, 43))  # ten full blocks of 4
    model = PeftModel.from_pretrained(make_model("llama_gqa"), adapters["a"],
                                      adapter_name="a").eval()
    engine = LLMEngine(model, block_size=4, num_blocks=200)

    def run(request_id, prompt):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=6))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        return done[request_id]

    as_a = run("1", long_prompt)
    assert TOKENIZER.decode(as_a.outputs[0].token_ids) == stock(long_prompt, adapters["a"])
    engine.add_request("2", PROMPT, SamplingParams(temperature=0, max_tokens=8))
    engine.lora.begin_unload("a")
    assert engine.lora.in_use("a")  # request 2 runs on a
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.lora.in_use("a")
    engine.lora.finish_unload("a")
    as_base = run("3", long_prompt)
    assert as_base.num_cached_tokens == 0
    assert TOKENIZER.decode(as_base.outputs[0].token_ids) == stock(long_prompt)


def test_an_unload_waits_for_a_request_queued_after_it_began(adapters):
    """A request prepared before `begin_unload` and queued after it (after the last check
    that the adapter was idle, on a server) runs on its adapter: the unload deletes the
    adapter only once that request is done (it ran the base model's tokens under the
    adapter's name)."""
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    late = engine.prepare_request("late", PROMPT, SamplingParams(temperature=0, max_tokens=6),
                                  adapter="a")
    engine.lora.begin_unload("a")
    assert not engine.lora.in_use("a")
    engine.add_prepared(late)
    assert engine.lora.finish_unload("a") is False and engine.adapters == ["a"]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert TOKENIZER.decode(done["late"].outputs[0].token_ids) == stock(PROMPT, adapters["a"])
    assert engine.lora.finish_unload("a") is True and engine.adapters == []


def test_a_request_prepared_before_its_adapter_was_unloaded_is_refused(adapters):
    """A request checked while its adapter was loaded and queued after the adapter was
    deleted fails by name: it would run the base model and cache blocks under the deleted
    adapter's name, which a reloaded adapter of that name would then find."""
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    late = engine.prepare_request("late", PROMPT, SamplingParams(temperature=0, max_tokens=4),
                                  adapter="a")
    engine.lora.begin_unload("a")
    engine.lora.finish_unload("a")
    with pytest.raises(InvalidRequestError, match="'a' was unloaded"):
        engine.add_prepared(late)
    assert not engine.requests and not engine.has_unfinished_requests()


@pytest.mark.parametrize("first", [None, "a"])  # a plain model, or one with an adapter
def test_a_load_that_fails_leaves_the_model_as_it_was(adapters, tmp_path, first):
    """PEFT puts an adapter's layers into the model before it loads their weights: a load
    whose weights do not fit (another width) must take them out again, so the base model
    (and adapters loaded before) keep their tokens and the name can be loaded later."""
    narrow = get_peft_model(make_model("llama_gqa", hidden_size=32, intermediate_size=64),
                            LoraConfig(task_type=TaskType.CAUSAL_LM, r=4,
                                       target_modules="all-linear", init_lora_weights=False))
    narrow.save_pretrained(tmp_path / "narrow")
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    if first:
        engine.lora.load(first, adapters[first])

    def text(adapter=None):
        engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=6),
                           adapter=adapter)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step())
        return TOKENIZER.decode(done["r"].outputs[0].token_ids, skip_special_tokens=True)

    with pytest.raises(InvalidRequestError) as err:
        engine.lora.load("x", tmp_path / "narrow")
    assert err.value.param == "lora_path" and engine.adapters == ([first] if first else [])
    assert text("__base__" if first else None) == stock(PROMPT)
    if first:
        assert text(first) == stock(PROMPT, adapters[first])
    engine.lora.load("x", adapters["b"])
    assert text("x") == stock(PROMPT, adapters["b"])


def engine_text(engine, adapter=None, request_id="r"):
    engine.add_request(request_id, PROMPT, SamplingParams(temperature=0, max_tokens=6),
                       adapter=adapter)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    return TOKENIZER.decode(done[request_id].outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("last", ["a", "head"])
def test_adapters_load_after_the_last_one_was_unloaded(adapters, last):
    """PEFT keeps a deleted adapter active when it was the last: every forward after a
    later load failed on its name (base model's requests too)."""
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    engine.lora.load(last, adapters[last])
    assert engine_text(engine, last) == stock(PROMPT, adapters[last])
    engine.lora.begin_unload(last)
    engine.lora.finish_unload(last)
    assert engine_text(engine) == stock(PROMPT)
    engine.lora.load("b", adapters["b"])
    assert engine_text(engine, "b") == stock(PROMPT, adapters["b"])
    assert engine_text(engine) == stock(PROMPT)


@pytest.mark.parametrize("given", [False, True])
def test_unloading_the_active_adapter_leaves_the_others_whole(tmp_path, given):
    """Adapters on different layers; the first (the one PEFT runs unnamed) is unloaded.
    PEFT moved each layer that ran it to an adapter of that layer's own (one with a head of
    its own kept running on the head), or kept its name as the model's (every later forward
    failed). The rest run as stock; a request naming none runs the base model, or, in a PEFT
    model given to the engine, the adapter that is now active (as PEFT's own delete picks)."""
    made = {name: save_adapter(tmp_path / name, seed, target_modules=targets)
            for name, seed, targets in (("qv", 5, ["q_proj", "v_proj"]), ("head", 6, ["lm_head"]),
                                        ("mlp", 7, ["down_proj", "up_proj"]))}
    model = make_model("llama_gqa")
    if given:
        model = PeftModel.from_pretrained(model, made["qv"], adapter_name="qv").eval()
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    for name in ("qv", "head", "mlp")[given:]:
        engine.lora.load(name, made[name])
    trainable = {id(p): p.requires_grad for p in engine.runner.model.parameters()}
    engine.lora.begin_unload("qv")
    assert engine.lora.finish_unload("qv")
    assert all(trainable[id(p)] == p.requires_grad for p in engine.runner.model.parameters())
    for name in ("head", "mlp"):
        assert engine_text(engine, name) == stock(PROMPT, made[name])
    assert engine_text(engine) == stock(PROMPT, made["head"] if given else None)


@pytest.mark.parametrize("first, second", [("head", "a"), ("a", "dora")])
def test_adapters_peft_cannot_run_side_by_side_are_refused(adapters, first, second):
    """A DoRA adapter cannot be named per request, and an adapter beside one with
    modules_to_save fails by name in PEFT: refused when loaded (the model and the adapters
    loaded before keep their tokens), not failing every request of theirs. Loaded the
    other way round both run (the first adapter runs unnamed)."""
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    engine.lora.load(first, adapters[first])
    with pytest.raises(InvalidRequestError, match="PEFT cannot run") as err:
        engine.lora.load(second, adapters[second])
    assert err.value.param == "lora_path" and engine.adapters == [first]
    assert engine_text(engine, first) == stock(PROMPT, adapters[first])
    assert engine_text(engine) == stock(PROMPT)
    model = PeftModel.from_pretrained(make_model("llama_gqa"), adapters[first],
                                      adapter_name=first)
    model.load_adapter(adapters[second], adapter_name=second)
    with pytest.raises(UnsupportedModelError, match=f"adapter '{second}'"):
        LLMEngine(model.eval(), block_size=4, num_blocks=200)
    engine = LLMEngine(make_model("llama_gqa"), block_size=4, num_blocks=200)
    for name in (second, first):
        engine.lora.load(name, adapters[name])
    for name in (second, first):
        assert engine_text(engine, name, name) == stock(PROMPT, adapters[name])


def test_a_runtime_adapter_stays_out_of_the_callers_model(adapters):
    """An adapter loaded at runtime into an engine serving a plain model goes into the
    engine's own copy of the model's modules (sharing its weights): the caller's model
    object, which it may still call itself or give to another engine, keeps running the base
    model, with its parameters' settings as they were."""
    model = make_model("llama_gqa")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(ids).logits
    trainable = [p.requires_grad for p in model.parameters()]
    modules = dict(model.named_modules())
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    other = LLMEngine(model, block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    assert dict(model.named_modules()) == modules  # no PEFT layer put in
    assert [p.requires_grad for p in model.parameters()] == trainable
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert engine_text(engine, "a") == stock(PROMPT, adapters["a"])
    assert engine_text(engine) == stock(PROMPT)
    assert engine_text(other) == stock(PROMPT)
    engine.lora.load("b", adapters["b"])
    assert engine_text(engine, "b") == stock(PROMPT, adapters["b"])
    for name in ("a", "b"):
        engine.lora.begin_unload(name)
        engine.lora.finish_unload(name)
    assert engine.runner.model is model and dict(model.named_modules()) == modules
    assert engine_text(engine) == stock(PROMPT)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_the_engines_copy_follows_the_callers_new_parameters(adapters):
    """With a runtime adapter, the engine runs its own copy of the model's modules: a
    Parameter the caller puts in place of another reaches it (base and adapter requests
    alike); a module put in place of another is a ModelChangedError naming it, until it is
    put back."""
    model = make_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    assert engine_text(engine) == stock(PROMPT)
    head = model.lm_head
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(head.weight.flip(0).clone())
    with_a = PeftModel.from_pretrained(make_model("llama_gqa"), adapters["a"]).eval()
    texts = {}
    for adapter, reference in ((None, make_model("llama_gqa")), ("a", with_a)):
        reference.get_output_embeddings().weight = model.lm_head.weight  # ("a" has no head)
        with torch.no_grad():
            out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=6,
                                     do_sample=False, pad_token_id=0)[0, len(PROMPT):]
        texts[adapter] = TOKENIZER.decode(out, skip_special_tokens=True)
        assert engine_text(engine, adapter) == texts[adapter]
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    with pytest.raises(ModelChangedError, match="the model's lm_head changed"):
        engine_text(engine)
    model.lm_head = head  # (the request stays queued, and runs now)
    assert engine_text(engine, request_id="r2") == texts[None]


def test_a_runtime_adapter_runs_in_a_model_with_device_hooks(adapters):
    """accelerate's device hooks (a `device_map` model) bind each hooked module's forward to
    the module: the engine's copy rebinds them to the copy, so its adapter layers run."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = make_model("llama_gqa")
    for module in (model, model.model, *model.model.layers):
        add_hook_to_module(module, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    assert engine_text(engine, "a") == stock(PROMPT, adapters["a"])
    assert engine_text(engine) == stock(PROMPT)
    assert model.forward.args[0] is model and model.forward.__wrapped__.__self__ is model


def test_the_engines_own_loads_keep_the_prefix_cache_and_an_owners_change_drops_it(adapters):
    """Loading and unloading adapters changes the model the engine runs, but not what the
    base model's cached blocks hold: they are found again after each. A change the
    model's owner made before one is still seen: nothing cached before it is found."""
    from test_engine import stock_greedy

    model = make_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    engine.lora.load("a", adapters["a"])
    want = stock(PROMPT)
    assert engine_text(engine) == want
    for change in [lambda: engine.lora.load("b", adapters["b"]),
                   lambda: (engine.lora.begin_unload("a"), engine.lora.finish_unload("a")),
                   lambda: engine.lora.load("a", adapters["a"])]:
        change()
        hits = engine.stats().prefix_cache_hit_tokens
        assert engine_text(engine) == want
        assert engine.stats().prefix_cache_hit_tokens > hits
    with torch.no_grad():  # (the engine's wrapped copy of the model shares its weights)
        model.model.layers[0].self_attn.v_proj.weight.mul_(-4)
    engine.lora.begin_unload("b")
    engine.lora.finish_unload("b")
    hits = engine.stats().prefix_cache_hit_tokens
    tuned = TOKENIZER.decode(stock_greedy(model, PROMPT, 6), skip_special_tokens=True)
    assert tuned != want
    assert engine_text(engine) == tuned
    assert engine.stats().prefix_cache_hit_tokens == hits


def test_llm_generate_takes_vllms_lora_request(adapters):
    """`LLM.generate(..., lora_request=LoRARequest(name, id, path))`, as vLLM's offline
    API names an adapter: loaded from its folder by the first call, run by name after; a
    prompt without one runs the base model; stock tokens throughout."""
    from hf_paged import LLM, LoRARequest

    llm = LLM(make_model("llama_gqa"), TOKENIZER, block_size=4, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=6)
    as_a, as_b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])

    def texts(**kw):
        return [o.outputs[0].text for o in llm.generate([PROMPT] * 3, params, use_tqdm=False,
                                                        **kw)]

    assert texts(lora_request=[as_a, None, as_b]) == [
        stock(PROMPT, adapters["a"]), stock(PROMPT), stock(PROMPT, adapters["b"])]
    assert texts(lora_request=as_b) == [stock(PROMPT, adapters["b"])] * 3
    assert sorted(llm.llm_engine.runner.adapters) == ["a", "b"]  # (each loaded once)
    with pytest.raises(ValueError, match="not both"):
        texts(lora_request=as_a, adapter="a")
    with pytest.raises(InvalidRequestError, match="lora_path"):
        texts(lora_request=LoRARequest("c", 3, adapters["a"] + "-missing"))
    assert llm.stats().running == llm.stats().waiting == 0


def test_async_llm_generate_takes_vllms_lora_request(adapters):
    """`AsyncLLM.generate(..., lora_request=...)` and `add_lora`, vLLM's names: the folder
    is loaded between steps the first time its name comes; stock tokens."""
    from hf_paged import AsyncLLM, LoRARequest

    llm = AsyncLLM(make_model("llama_gqa"), TOKENIZER, block_size=4, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=6)
    as_a, as_b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])

    async def text(rid, **kw):
        async for out in llm.generate(PROMPT, params, rid, **kw):
            pass
        return out.outputs[0].text

    async def main():
        assert await llm.add_lora(as_b) is True
        texts = await asyncio.gather(text("1", lora_request=as_a), text("2"),
                                     text("3", lora_request=as_b))
        texts.append(await text("4", adapter="a"))  # (loaded by request 1: by name now)
        with pytest.raises(ValueError, match="not both"):
            await text("5", lora_request=as_a, adapter="a")
        with pytest.raises(InvalidRequestError, match="lora_path"):
            await text("6", lora_request=LoRARequest("c", 3, adapters["a"] + "-missing"))
        return texts

    try:
        assert asyncio.run(main()) == [stock(PROMPT, adapters["a"]), stock(PROMPT),
                                       stock(PROMPT, adapters["b"]),
                                       stock(PROMPT, adapters["a"])]
        assert sorted(llm.adapters) == ["a", "b"] and llm.is_alive
    finally:
        llm.shutdown()
