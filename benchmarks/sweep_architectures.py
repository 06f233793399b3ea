"""Which of the installed Transformers' causal-LM architectures the paged cache serves, and
whether it serves them correctly: a tiny random model of every `*ForCausalLM` model type.

    python benchmarks/sweep_architectures.py                        # every model type, CPU
    python benchmarks/sweep_architectures.py --only llama,gpt2,dbrx --out sweep.jsonl

For each model type (Transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) a child process builds
a tiny random model (hidden size 64, two layers, vocabulary 128) and compares stock greedy
`generate` (DynamicCache) with `generate(cache_implementation="paged")` and with the
`hf_paged.LLM` engine, on two prompts of 9 and 5 tokens (a left-padded batch, and singly),
12 new tokens each. Each model gets one class:
  a  every output matches stock generate
  b  refused with a reason (UnsupportedModelError, or generate's fallback warning)
  c  wrong tokens
  d  any other failure (an exception, a request error, a crash or a timeout)
  e  the tiny config could not be built (or has over MAX_PARAMETERS parameters: BLT's
     sub-configs), or stock generate itself fails (or the child was killed or timed out
     before stock generate finished)
One JSON line per model goes to --out (or stdout); a summary table follows at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections import defaultdict

VOCAB, PAD, EOS, BOS = 128, 0, 1, 2
PROMPT_LENS, NEW_TOKENS = (9, 5), 12
RESULT_PREFIX = "SWEEP_RESULT "
STOCK_DONE = "SWEEP_STOCK_DONE"  # the child built the model and ran stock generate
UNSET = object()  # an override value that removes the base setting
MAX_PARAMETERS = 5_000_000  # a bigger "tiny" model is not built

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
            bos_token_id=BOS, tie_word_embeddings=False, is_decoder=True,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, n_group=1,
            topk_group=1, first_k_dense_replace=1, sliding_window=6)

# Multi-head latent attention: low-rank KV sizes (head_dim is derived from them).
MLA = dict(num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=12, head_dim=UNSET)
MLA_INDEXER = dict(MLA, q_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=4)
# Encoder-decoder families name their sizes per stack.
ENCDEC = dict(d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
              encoder_attention_heads=4, decoder_ffn_dim=96, encoder_ffn_dim=96,
              num_hidden_layers=UNSET, num_attention_heads=UNSET)
# "config_cls": the causal-LM class takes the text/decoder sub-config, not the model type's.
# "seed": the model's random init seed (default 0).
OVERRIDES = {
    "axk1": dict(MLA, n_shared_experts=1, q_lora_rank=32),
    "deepseek_v2": dict(MLA, n_shared_experts=1, seed=1),
    "deepseek_v3": dict(MLA, n_shared_experts=1),
    "falcon": dict(head_dim=UNSET),  # (a property of FalconConfig)
    "glm4_moe_lite": dict(MLA, n_shared_experts=1),
    "minicpm3": MLA,
    "youtu": MLA,
    "longcat_flash": dict(MLA, q_lora_rank=32, num_layers=2, num_hidden_layers=UNSET,
                          ffn_hidden_size=96, expert_ffn_hidden_size=32, moe_topk=2,
                          zero_expert_num=1, qk_head_dim=24, head_dim=8),
    "deepseek_v32": MLA_INDEXER,
    "glm_moe_dsa": MLA_INDEXER,
    "axk2": MLA_INDEXER,
    "dots1": dict(n_shared_experts=1),
    "dots3_note": dict(num_key_value_heads=4, config_cls="Dots3NoteTextConfig"),
    "dots3_note_text": dict(num_key_value_heads=4),
    "codegen": dict(rotary_dim=8),  # rotary part of the 16-wide heads
    "gptj": dict(rotary_dim=8),
    "cohere_compass_text": dict(  # one sliding and one full layer, with per-type RoPE
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(  # nested attention/FFN configs; 2 KV heads to 4 query heads
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), d_model=64,
        n_heads=4, n_layers=2, max_seq_len=512,
        ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
    "emu3": dict(config_cls="Emu3TextConfig"),
    "mllama": dict(config_cls="MllamaTextConfig", cross_attention_layers=[]),
    "musicgen": dict(config_cls="MusicgenDecoderConfig", ffn_dim=96, num_codebooks=1,
                     audio_channels=1),
    "musicgen_melody": dict(config_cls="MusicgenMelodyDecoderConfig", ffn_dim=96,
                            num_codebooks=1, audio_channels=1),
    "gemma3n_text": dict(  # no KV sharing; one sliding and one full layer; small per-layer inputs
        num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, laurel_rank=8,
        activation_sparsity_pattern=[0.0, 0.0]),
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    window_size=6),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),  # heads * head_dim = 2 * hidden
    "zamba": dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
    "lfm2": dict(num_hidden_layers=4, full_attn_idxs=[1, 3]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    # (hybrids whose two default layers would hold no attention layer)
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    **{mt: ENCDEC for mt in ["bart", "mbart", "pegasus", "blenderbot", "blenderbot-small",
                             "mvp", "plbart"]},
    "marian": dict(ENCDEC, decoder_vocab_size=VOCAB),
    "bigbird_pegasus": dict(ENCDEC, attention_type="original_full"),  # no block-sparse at 14 tokens
    "whisper": dict(ENCDEC, max_target_positions=512),
    "prophetnet": dict(num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, decoder_ffn_dim=96, encoder_ffn_dim=96,
                       num_hidden_layers=UNSET),
    "xmod": dict(default_language="en_XX"),
}


def model_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build(model_type):
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    overrides = dict(OVERRIDES.get(model_type, {}))
    config_cls = CONFIG_MAPPING[model_type]
    if "config_cls" in overrides:
        config_cls = getattr(transformers, overrides.pop("config_cls"))
    seed = overrides.pop("seed", 0)
    kwargs = dict(BASE)
    fields = set(getattr(config_cls, "__dataclass_fields__", {}))
    if "sliding_window" not in fields | set(getattr(config_cls, "attribute_map", {})):
        del kwargs["sliding_window"]
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not UNSET}
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = config_cls(**kwargs)
    with torch.device("meta"):  # (sub-configs these sizes miss stay large: BLT's take >20 GB)
        size = sum(p.numel() for p in model_cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny {model_cls.__name__} still has {size:,} parameters")
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and head.weight is not model.get_input_embeddings().weight:
        with torch.no_grad():  # sharper logits: fewer near-ties between greedy candidates
            head.weight.mul_(8.0)
    return model


def left_pad(prompts):
    import torch
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def generate(model, prompts, paged):
    import torch
    ids, mask = left_pad(prompts)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    if paged:
        kwargs["cache_implementation"] = "paged"
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return out[:, ids.shape[1]:].tolist()


def error(e):
    return f"{type(e).__name__}: {e}"[:400]


def run_one(model_type):
    """Builds one tiny model and compares the three ways of generating; returns the record."""
    import torch
    import hf_paged

    rec = {"model_type": model_type}
    try:
        model = build(model_type)
        rec["model_class"] = type(model).__name__
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        stock_batch = generate(model, prompts, paged=False)
        stock_single = [generate(model, [p], paged=False)[0] for p in prompts]
    except Exception as e:
        return dict(rec, **{"class": "e", "error": error(e), "traceback": traceback.format_exc()[-1500:]})
    rec.update(stock_batch=stock_batch, stock_single=stock_single)
    print(STOCK_DONE, flush=True)
    wrong, failed = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rec["paged_batch"] = generate(model, prompts, paged=True)
            rec["paged_single"] = generate(model, prompts[:1], paged=True)
            if rec["paged_batch"] != stock_batch:
                wrong.append("paged generate (batch) != stock batch")
            if rec["paged_single"] != stock_single[:1]:
                wrong.append("paged generate (single) != stock single")
        except Exception as e:
            failed.append("paged generate raised " + error(e))
    rec["warnings"] = [str(w.message)[:400] for w in caught if "hf-paged" in str(w.message)]
    try:
        llm = hf_paged.LLM(model, num_blocks=64, block_size=4)
        params = hf_paged.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        rec["engine"] = [list(o.outputs[0].token_ids) for o in outs]
        request_errors = [getattr(o, "error", None) for o in outs]
        if any(request_errors):
            failed.append("engine request error " + str(request_errors)[:300])
        elif rec["engine"] != stock_single:
            wrong.append("engine != stock single")
    except hf_paged.UnsupportedModelError as e:
        rec["engine_refused"] = str(e)[:600]
    except Exception as e:
        failed.append("engine raised " + error(e))
    rec["problems"] = wrong + failed
    if wrong:
        rec["class"] = "c"
    elif failed:
        rec["class"] = "d"
    else:
        rec["class"] = "b" if rec.get("engine_refused") or rec["warnings"] else "a"
    return rec


def child_main(model_type):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU
    os.environ.setdefault("HF_PAGED_DEBUG", "1")  # the engine checks every step's blocks
    import torch
    torch.set_num_threads(1)
    print(RESULT_PREFIX + json.dumps(run_one(model_type)), flush=True)


def run_child(model_type, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", model_type]
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, ended = proc.stdout, proc.stderr, f"exited {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        stdout, stderr, ended = e.stdout or "", e.stderr or "", f"timed out after {timeout} s"
        stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x
                          for x in (stdout, stderr))
    lines = [l for l in stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if lines:
        rec = json.loads(lines[-1][len(RESULT_PREFIX):])
    else:  # killed (out of memory, say) or timed out: whose fault depends on how far it got
        stock_ran = STOCK_DONE in stdout.splitlines()
        rec = {"model_type": model_type, "class": "d" if stock_ran else "e",
               "problems": [f"child {ended} without a result, "
                            + ("after stock generate" if stock_ran
                               else "before stock generate finished (building the tiny model "
                                    "or stock generate)")],
               "stderr": stderr[-1500:]}
    rec["seconds"] = round(time.time() - start, 1)
    return rec


def summary(records):
    by_class = defaultdict(list)
    for r in records:
        by_class[r["class"]].append(r["model_type"])
    print(f"\n{'class':<6}{'count':>6}  model types")
    for cls in "abcde":
        print(f"{cls:<6}{len(by_class[cls]):>6}  {', '.join(sorted(by_class[cls]))}")
    print(f"{'total':<6}{len(records):>6}")
    for r in records:
        if r["class"] in "cd":
            print(f"  {r['class']} {r['model_type']}: {'; '.join(r.get('problems', []))[:200]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per model type")
    parser.add_argument("--out", help="JSON lines file (default: print to stdout)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return child_main(args.one)
    types = model_types()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(types))
        if unknown:
            parser.error(f"not causal-LM model types: {', '.join(unknown)}")
        types = [t for t in types if t in wanted]
    out = open(args.out, "w") if args.out else sys.stdout
    records = []
    for i, model_type in enumerate(types, 1):
        rec = run_child(model_type, args.timeout)
        records.append(rec)
        print(json.dumps(rec), file=out, flush=True)
        print(f"[{i}/{len(types)}] {model_type}: {rec['class']} ({rec.get('seconds', '-')} s)",
              file=sys.stderr, flush=True)
    if args.out:
        out.close()
    summary(records)


if __name__ == "__main__":
    main()
