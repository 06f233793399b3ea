"""Fine-tuned models on the paged cache, against stock generate with the same seeds: PEFT
(LoRA, mixed adapter batches, prompt and prefix tuning), models still in training mode,
wrappers around the forward, and Falcon-RW under the "paged" attention name."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
from transformers import LlamaForCausalLM

import hf_paged
from hf_paged import HFPagedError, PagedCache
from hf_paged.hf import probe
from conftest import assert_same, both, left_padded_batch, make_model

MODES = {
    "no padding": dict(lengths=[5, 5]),
    "padded": dict(lengths=[5, 9]),
    "beams": dict(lengths=[5, 9], num_beams=3),
    "sampling, 2 each": dict(lengths=[5, 9], do_sample=True, num_return_sequences=2),
}


def peft_model(kind: str, method: str):
    base = make_model(kind)
    if method == "lora":
        config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                            init_lora_weights=False)
    elif method == "prompt":
        config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    else:
        config = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    model = get_peft_model(base, config).eval()
    if method != "lora":  # trained-looking virtual tokens, far from the base model
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.prompt_encoder.parameters():
                p.normal_(0, 1)
    return model


def generate_both(model, mode: dict, seed: int = 0, **extra):
    """(stock output, paged output), both with `.sequences`, `.logits` and `.past_key_values`."""
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    kwargs.update(mode)
    ids, mask = left_padded_batch(kwargs.pop("lengths"), seed=3)
    kwargs.update(extra, input_ids=ids, attention_mask=mask)
    return generate_pair(model, kwargs, seed)


def generate_pair(model, kwargs, seed: int = 0):
    torch.manual_seed(seed)
    ref = model.generate(**kwargs)
    torch.manual_seed(seed)
    return ref, model.generate(**kwargs, cache_implementation="paged")


def assert_same_logits(ref, out):
    assert_same(ref, out)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["lora", "prompt", "prefix"])
@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_peft_methods_match_stock_on_the_paged_cache(kind, method, mode):
    model = peft_model(kind, method)
    with model.disable_adapter():
        base_ref, _ = generate_both(model, MODES[mode])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "hf-paged")  # no fallback to the stock cache
        ref, out = generate_both(model, MODES[mode])
    assert_same_logits(ref, out)
    assert isinstance(out.past_key_values, PagedCache)
    # The adapter mattered (paged dropping it would give the base model's logits).
    assert (ref.logits[0] - base_ref.logits[0]).abs().max() > 1e-2


def test_prefix_tuning_tokens_are_stored_once_for_all_rows():
    model = peft_model("llama_gqa", "prefix")
    ids, mask = left_padded_batch([5, 9], seed=3)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=1,
                         cache_implementation="paged", cache_config={"block_size": 4},
                         return_dict_in_generate=True)
    stats = out.past_key_values.memory_stats()
    assert stats.shared_blocks >= 1  # the 4 virtual tokens: one block held by every row
    assert stats.tokens_stored < stats.logical_tokens


def test_prefix_tuning_that_the_cache_cannot_hold_runs_stock_with_a_warning():
    """Falcon's new decoder architecture caches one K/V per query head, and a prefix is
    free per head: it does not fit the unique KV heads the paged cache stores."""
    model = peft_model("falcon_new", "prefix")
    with pytest.warns(UserWarning, match="prefix tuning"):
        ref, out = generate_both(model, MODES["padded"])
    assert_same_logits(ref, out)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_mq"])
def test_mixed_adapter_batch(kind, monkeypatch):
    # The route probe then first runs inside PEFT's generate, whose hooks hand every LoRA
    # layer the batch's adapter names: it must not trip on them (whatever ran before).
    monkeypatch.setattr(probe, "_checked", {})
    lora = dict(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                init_lora_weights=False)
    model = get_peft_model(make_model(kind), LoraConfig(**lora), adapter_name="a")
    model.add_adapter("b", LoraConfig(**lora))
    model.eval()
    mode = dict(lengths=[5, 9, 3, 7])
    ref, out = generate_both(model, mode, adapter_names=["a", "b", "__base__", "a"])
    assert_same_logits(ref, out)
    assert isinstance(out.past_key_values, PagedCache)
    single, _ = generate_both(model, mode)  # the active adapter everywhere
    assert (ref.logits[0] - single.logits[0]).abs().max() > 1e-2


class ShiftedPositions(LlamaForCausalLM):
    """A subclass that changes the inputs generate builds (as some model code does)."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        if inputs.get("position_ids") is not None:
            inputs["position_ids"] = inputs["position_ids"] + 7
        return inputs


def test_subclass_overriding_prepare_inputs():
    torch.manual_seed(0)
    model = ShiftedPositions(make_model("llama_gqa").config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    for mode in ("padded", "beams"):
        ref, out = generate_both(model, MODES[mode])
        assert_same_logits(ref, out)


# -- models left in training mode -----------------------------------------------------------
def with_attention_dropout(model, p: float):
    """As if built with config.attention_dropout = p (attention modules keep their own copy:
    a float in Llama and Mistral, a Dropout module in Falcon)."""
    model.config.attention_dropout = p
    for module in model.modules():
        if isinstance(getattr(module, "attention_dropout", None), torch.nn.Dropout):
            module.attention_dropout.p = p
        elif hasattr(module, "attention_dropout"):
            module.attention_dropout = p
    return model


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_new"])
def test_gradient_checkpointing_in_training_mode_runs_stock(kind):
    model = make_model(kind)
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.warns(UserWarning, match=r"gradient checkpointing.*model\.eval\(\)"):
        ref, out = generate_both(model, MODES["padded"])
    assert_same(ref, out)
    assert not isinstance(out.past_key_values, PagedCache)
    model.eval()  # the paged cache is back
    ref, out = generate_both(model, MODES["padded"])
    assert_same(ref, out)
    assert isinstance(out.past_key_values, PagedCache)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_attention_dropout_in_training_mode_runs_stock(kind):
    model = with_attention_dropout(make_model(kind), 0.3)
    model.train()
    with pytest.warns(UserWarning, match="attention dropout"):
        ref, out = generate_both(model, MODES["sampling, 2 each"], seed=4)
    assert_same(ref, out)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_alibi"])
def test_dropout_outside_attention_in_training_mode_stays_paged(kind):
    """LoRA dropout (and Falcon's hidden dropout) draw the same random numbers on the paged
    cache as on the stock one: the forwards have the same shapes."""
    model = get_peft_model(make_model(kind), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear", lora_dropout=0.3,
        init_lora_weights=False))
    if kind == "falcon_alibi":  # Falcon's hidden dropout too (not its attention dropout)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Dropout) and "attention" not in name \
                    and module.p == 0.0:
                module.p = 0.2
    model.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "hf-paged")
        for mode in ("padded", "sampling, 2 each"):
            ref, out = generate_both(model, MODES[mode], seed=5)
            assert_same(ref, out)
            assert isinstance(out.past_key_values, PagedCache)
    model.eval()
    evaluated, _ = generate_both(model, MODES["padded"], seed=5)
    train_ref, _ = generate_both(model.train(), MODES["padded"], seed=5)
    assert (evaluated.logits[0] - train_ref.logits[0]).abs().max() > 1e-2  # dropout acted


def test_paged_cache_passed_in_training_mode_with_attention_dropout_is_refused():
    model = with_attention_dropout(make_model("llama_gqa"), 0.3)
    model.train()
    ids, mask = left_padded_batch([5, 9], seed=3)
    with pytest.raises(HFPagedError, match="model.eval"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                       past_key_values=PagedCache(model.config))


# -- Falcon-RW under the "paged" name, on Transformers' own caches ------------------------------
def test_falcon_alibi_loaded_with_paged_matches_sdpa(tmp_path):
    from transformers import AutoModelForCausalLM

    make_model("falcon_alibi").save_pretrained(tmp_path)
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="paged").eval()
    ids, mask = left_padded_batch([5, 9], seed=3)
    with torch.no_grad():
        a = sdpa(input_ids=ids, attention_mask=mask).logits
        b = paged(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # Training loss (no cache) too.
    labels = ids.masked_fill(mask == 0, -100)
    loss_a = sdpa(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss_b = paged(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss_b, loss_a)
    for mode in ("padded", "beams", "sampling, 2 each"):
        kwargs = dict(MODES[mode])
        ids, mask = left_padded_batch(kwargs.pop("lengths"), seed=3)
        common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        torch.manual_seed(0)
        ref = sdpa.generate(**common)
        torch.manual_seed(0)
        plain = paged.generate(**common)  # Transformers' DynamicCache, "paged" attention
        torch.manual_seed(0)
        out = paged.generate(**common, cache_implementation="paged")
        assert_same(ref, plain)
        assert_same(ref, out)


# -- settings that would be ignored ---------------------------------------------------------------
def test_cache_config_without_paged_implementation_warns(llama):
    ids, mask = left_padded_batch([5, 9], seed=3)
    with pytest.warns(UserWarning, match="no effect without cache_implementation='paged'"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                       cache_config={"block_size": 8})


def test_model_generation_config_with_paged_is_picked_up(tmp_path):
    """A saved model whose generation_config.json says "paged" uses the plugin once
    hf_paged is imported."""
    from transformers import AutoModelForCausalLM

    model = make_model("llama_gqa")
    model.generation_config.cache_implementation = "paged"
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.cache_implementation == "paged"
    ids, mask = left_padded_batch([5, 9], seed=3)
    out = loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                          return_dict_in_generate=True)
    assert isinstance(out.past_key_values, PagedCache)
    assert hf_paged.is_enabled()


# -- the fine-tune-then-generate workflow (examples/finetune_then_serve.py, smaller) ---------------
def load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_then_serve.py"
    spec = importlib.util.spec_from_file_location("finetune_then_serve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """A saved base model, two LoRA adapters trained with Trainer, and the first adapter's
    model right after training (still in training mode, LoRA dropout on)."""
    ex = load_example()
    out = tmp_path_factory.mktemp("finetune")
    tokenizer = ex.build_tokenizer()
    ex.build_base_model().save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    just_trained = ex.train_adapter(ex.build_base_model(), 40, out / "a")
    ex.train_adapter(ex.build_base_model(), 15, out / "b", seed=1)
    return ex, out, tokenizer, just_trained


def workflow_modes(ex, tokenizer):
    inputs = tokenizer(ex.PROMPTS, return_tensors="pt", padding=True)
    base = dict(**inputs, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    return {"greedy": dict(base, do_sample=False),
            "beams": dict(base, num_beams=3, num_return_sequences=2, do_sample=False),
            "sampling": dict(base, do_sample=True, num_return_sequences=2)}


def assert_paged_like_stock(model, modes):
    for kwargs in modes.values():
        ref, out = generate_pair(model, kwargs)
        assert_same_logits(ref, out)
        assert isinstance(out.past_key_values, PagedCache)
    return ref


def test_generate_right_after_training(workflow):
    """trainer.train() leaves the model in training mode with LoRA dropout on: the paged
    cache gives stock's tokens with the same seed."""
    ex, _, tokenizer, just_trained = workflow
    assert just_trained.training
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "hf-paged")
        assert_paged_like_stock(just_trained, workflow_modes(ex, tokenizer))


@pytest.mark.parametrize("attn_implementation", [None, "paged"])
def test_reloaded_adapter_unmerged_and_merged(workflow, attn_implementation):
    from transformers import AutoModelForCausalLM, pipeline
    from peft import PeftModel

    ex, out, tokenizer, _ = workflow
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    base = AutoModelForCausalLM.from_pretrained(out / "base", **kwargs)
    model = PeftModel.from_pretrained(base, out / "a").eval()
    modes = workflow_modes(ex, tokenizer)
    assert_paged_like_stock(model, modes)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    call = dict(max_new_tokens=6, do_sample=False, batch_size=4)
    assert [r[0]["generated_text"] for r in pipe(ex.PROMPTS, cache_implementation="paged", **call)] \
        == [r[0]["generated_text"] for r in pipe(ex.PROMPTS, **call)]
    merged = model.merge_and_unload()
    assert not isinstance(merged, PeftModel)
    assert_paged_like_stock(merged, modes)
    # It learned to count: the trained model continues "n5 n6 n7" with "n8".
    greedy = merged.generate(**{k: v for k, v in modes["greedy"].items()
                                if k not in ("return_dict_in_generate", "output_logits")},
                             cache_implementation="paged")
    assert tokenizer.decode(greedy[0, -6]) == "n8"


def test_two_adapters_switched_with_set_adapter(workflow):
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    ex, out, tokenizer, _ = workflow
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"),
                                      out / "a", adapter_name="a")
    model.load_adapter(out / "b", adapter_name="b")
    model.eval()
    modes = workflow_modes(ex, tokenizer)
    results = {}
    for name in ("b", "a", "b"):
        model.set_adapter(name)
        results[name] = assert_paged_like_stock(model, {"greedy": modes["greedy"]})
    assert (results["a"].logits[0] - results["b"].logits[0]).abs().max() > 1e-2


def test_trl_sft_trainer_then_paged_generate(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ex = load_example()
    tokenizer = ex.build_tokenizer()
    texts = [" ".join(f"n{s + j}" for j in range(12)) for s in range(50)]
    config = SFTConfig(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=8,
                       learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                       disable_tqdm=True)
    trainer = SFTTrainer(model=ex.build_base_model(), args=config, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": texts}),
                         peft_config=ex.lora_config())
    trainer.train()
    model = trainer.model
    assert model.training  # as a user would call generate right away
    modes = workflow_modes(ex, tokenizer)
    # SFTConfig turns gradient checkpointing on, and in training mode Transformers then
    # generates without a cache: stock runs, with a warning saying what to do.
    assert model.get_base_model().is_activation_checkpointing
    with pytest.warns(UserWarning, match=r"gradient checkpointing.*model\.eval\(\)"):
        ref, out = generate_pair(model, modes["greedy"])
    assert_same_logits(ref, out)
    model.eval()
    assert_paged_like_stock(model, modes)
