"""`LLM.beam_search`, vLLM's offline beam search on the engine: every returned sequence and
its cumulative log-probability equal the same search run on stock forwards of the whole
sequence (no cache), with EOS completing beams or ignored, several length penalties, and
several prompts and adapters in one call."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import LLM, BeamSearchParams, InvalidRequestError, LoRARequest
from conftest import EOS, make_model, make_tokenizer


def stock_beam_search(model, prompt, params: BeamSearchParams, eos: set[int],
                      context: int = 10**9):
    """The search written out on stock full forwards: [(tokens, cum_logprob)], best first
    (a beam of `context` tokens is complete). The length in a score leaves out a final EOS
    also when EOS does not complete a beam (as vLLM's)."""
    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == EOS)) ** params.length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        done += [beam for beam in live if len(beam[0]) >= context]
        live = [beam for beam in live if len(beam[0]) < context]
        if not live:
            break
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * params.beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token in eos else grown).append((tokens + [token], cum + value))
        live = sorted(grown, key=score, reverse=True)[:params.beam_width]
    return sorted(done + live, key=score, reverse=True)[:params.beam_width]


@pytest.fixture(scope="module")
def eos_prone():
    """A model whose EOS is often among the candidates, so that beams complete."""
    model = copy.deepcopy(make_model("llama_gqa"))
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4
    return model


PROMPTS = [[3, 4, 5, 6, 7], [9, 30, 31, 60, 61, 62, 63, 64, 65, 11], [40]]


@pytest.mark.parametrize("width, length_penalty, ignore_eos", [
    (1, 1.0, False), (3, 1.0, False), (4, 0.5, False), (3, 2.0, True)])
def test_beam_search_equals_the_search_on_stock_forwards(eos_prone, width, length_penalty,
                                                         ignore_eos):
    llm = LLM(eos_prone, make_tokenizer(), block_size=4, num_blocks=120)
    params = BeamSearchParams(beam_width=width, max_tokens=7, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    eos = set() if ignore_eos else {EOS}
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        ref = stock_beam_search(eos_prone, prompt, params, eos)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (_, cum) in zip(out.sequences, ref):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert all(token in offered for token, offered
                       in zip(seq.tokens[len(prompt):], seq.logprobs))
            assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos else "length")
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # (as vLLM: all of it)
            stopped += seq.finish_reason == "stop"
    assert stopped or ignore_eos or width == 1  # (the test is also about completed beams)
    assert not llm.engine.has_unfinished_requests()


def test_a_beam_that_fills_the_context_is_complete():
    """vLLM drops such a beam, and returned no sequence when all did."""
    model = make_model("llama_gqa", max_position_embeddings=12)
    llm = LLM(model, make_tokenizer(), block_size=4, num_blocks=60)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 11)), list(range(20, 32))]  # (8 tokens, and already full)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs):
        ref = stock_beam_search(model, prompt, params, set(), context=12)
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
        assert all(len(s.tokens) == 12 and s.finish_reason == "length" for s in out.sequences)
    assert len(outs[0].sequences) == 3 and outs[1].sequences[0].tokens == prompts[1]
    with pytest.raises(InvalidRequestError, match="13 tokens exceeds the model's context"):
        llm.beam_search([prompts[0], list(range(20, 33))], params)
    assert not llm.engine.has_unfinished_requests()


def test_one_prompt_text_or_ids_and_adapters_per_prompt(tmp_path):
    """A text prompt is tokenized as `generate` does it; each prompt may name its adapter
    (vLLM's LoRARequest, loaded from its folder), whose beams run on it."""
    from test_engine import long_model, two_adapter_model

    peft_model = two_adapter_model("a", "b")
    peft_model.save_pretrained(str(tmp_path), selected_adapters=["b"])
    tok = make_tokenizer()
    base = long_model("llama_gqa")
    llm = LLM(base, tok, block_size=4, num_blocks=200)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    ids = tok("w5 w6 w7")["input_ids"]
    [text] = llm.beam_search("w5 w6 w7", params)
    [same] = llm.beam_search(ids, params)
    assert [s.tokens for s in text.sequences] == [s.tokens for s in same.sequences]
    lora = LoRARequest("b", 1, str(tmp_path / "b"))
    outs = llm.beam_search([ids, ids], params, lora_request=[None, lora])
    ref_base = stock_beam_search(base, ids, params, set())
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "b")).eval()
    ref_b = stock_beam_search(tuned, ids, params, set())
    assert [s.tokens for s in outs[0].sequences] == [t for t, _ in ref_base]
    assert [s.tokens for s in outs[1].sequences] == [t for t, _ in ref_b] != \
        [t for t, _ in ref_base]
    assert outs[1].sequences[0].lora_request is lora and not outs[0].sequences[0].lora_request


def test_prompts_in_turns_and_bad_arguments():
    """concurrency_limit searches that many prompts at a time (the same results); an empty
    prompt or a lora_request of another type is refused before any step."""
    llm = LLM(make_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=100)
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    whole = [[s.tokens for s in out.sequences] for out in llm.beam_search(prompts, params)]
    turns = llm.beam_search(prompts, params, concurrency_limit=2)
    assert [[s.tokens for s in out.sequences] for out in turns] == whole
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.beam_search([[3, 4], []], params)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.beam_search(prompts, params, lora_request="x")
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, name", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
    ({"beam_width": True, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_beam_search_params_are_named(fields, name):
    with pytest.raises(InvalidRequestError, match=f"BeamSearchParams.{name}") as err:
        BeamSearchParams(**fields)
    assert err.value.param == name


def test_async_llm_beam_search_yields_the_beams_as_completions(eos_prone):
    """vLLM's engine-client form: one finished RequestOutput, a completion per beam, best
    first, with the generated tokens and their text without a final EOS."""
    import asyncio

    from hf_paged import AsyncLLM

    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompt = PROMPTS[0]
    ref = stock_beam_search(eos_prone, prompt, params, {EOS})
    tok = make_tokenizer()
    llm = AsyncLLM(eos_prone, tok, block_size=4, num_blocks=120)

    async def search():
        return [out async for out in llm.beam_search(prompt, "b", params)]

    try:
        [out] = asyncio.run(search())
    finally:
        llm.shutdown()
    assert out.finished and out.prompt_token_ids == prompt
    assert [c.token_ids for c in out.outputs] == [t[len(prompt):] for t, _ in ref]
    for c, (tokens, cum) in zip(out.outputs, ref):
        assert c.cumulative_logprob == pytest.approx(cum, abs=1e-4)
        ended = tokens[-1] == EOS
        assert c.finish_reason == ("stop" if ended else "length")
        assert c.text == tok.decode(c.token_ids[:-1] if ended else c.token_ids,
                                    skip_special_tokens=True)
    assert any(c.finish_reason == "stop" for c in out.outputs)  # (the test is about EOS too)
