"""Hugging Face model directories loaded as they are (ddserve.engine.hf_models): tiny random
models written by transformers itself give transformers' own logits and greedy tokens through
our forward and the engine; what the engine cannot run exactly is refused by name."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ddserve.config.engine import LiveParams
from ddserve.engine.drafters import NGramDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import load_model, load_tokenizer
from ddserve.errors import ConfigError

SHAPE = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# Llama 3.1's scaling with a short original context, so that the 8 frequencies of a 16-wide
# head fall in all three bands (kept, interpolated, divided by the factor)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4,"]


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random, norms and biases too (an all-ones norm or a zero bias would
    pass a test that forgot to load it), scaled so that logits are peaked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise * 2.0 / p.shape[-1] ** 0.5)
    return model.eval()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """Tied embeddings (no lm_head.weight in the files), GQA, rope_theta, llama3 scaling."""
    cfg = LlamaConfig(
        **SHAPE,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=True,
    )
    return randomize(LlamaForCausalLM(cfg), seed)


def tiny_qwen2(seed: int = 1) -> Qwen2ForCausalLM:
    """q/k/v biases, an untied LM head."""
    cfg = Qwen2Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=False)
    return randomize(Qwen2ForCausalLM(cfg), seed)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")  # the bundled model's, offline


def write_model(directory, hf_model, tokenizer, max_shard_size=None):
    """What a Hugging Face download looks like: config.json, safetensors (sharded with an
    index when max_shard_size is small), generation_config.json, tokenizer files."""
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(directory, **kw)
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_llama(directory, tokenizer) -> LlamaForCausalLM:
    """The tiny Llama as a sharded directory (also served by tests/api/test_hf_model_server.py)."""
    hf = tiny_llama()
    write_model(directory, hf, tokenizer, max_shard_size="2MB")
    return hf


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        hf = write_tiny_llama(directory, tokenizer)
        assert (directory / "model.safetensors.index.json").exists()  # sharded
    else:
        hf = tiny_qwen2()
        write_model(directory, hf, tokenizer)
    return directory, hf


def test_logits_equal_transformers(model_dir, tokenizer):
    directory, hf = model_dir
    lm = load_model(str(directory))
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        mine = lm.model(torch.tensor(ids), torch.arange(len(ids)), lm.model.new_cache())
        assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (text, (mine - ref).abs().max())


def test_greedy_through_the_engine_equals_transformers_generate(model_dir, tokenizer):
    """Speculative rounds (n-gram drafts, budget 6) commit exactly transformers' greedy tokens."""
    directory, hf = model_dir
    model = load_model(str(directory), with_tokenizer=False).model
    engine = StaticEngine(
        model, NGramDrafter(model.cfg.vocab_size), 6, (), slots=2, max_context=128, graphs=False
    )
    hf.generation_config.eos_token_id = None  # both run the full length
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        seq = engine.generate(ids, SamplingParams(max_tokens=16), LiveParams(budget=6, topk=2))
        assert seq.output == ref.tolist(), text


def test_the_directory_brings_its_tokenizer_chat_template_and_eos(model_dir, tokenizer):
    directory, _ = model_dir
    gen = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    lm = load_model(str(directory))
    msgs = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
    assert set(lm.model.cfg.eos_token_ids) >= {2, 7}


def edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(
    "changes,named",
    [
        (
            {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
            "model_type='gemma2' (architectures ['Gemma2ForCausalLM']) is not supported; "
            "the builtin engine runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_scaling type 'yarn' is not supported",
        ),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_what_the_engine_cannot_run_exactly_is_refused_by_name(tmp_path, tokenizer, changes, named):
    write_model(tmp_path, tiny_llama(), tokenizer)
    edit_config(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        load_model(str(tmp_path))
    assert named in e.value.message and "\n" not in e.value.message
    assert e.value.message.startswith(f"model={str(tmp_path)!r}: ")


def test_missing_weights_and_pytorch_bin_are_refused(tmp_path, tokenizer):
    write_model(tmp_path, tiny_llama(), tokenizer)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"weights as \*\.safetensors"):
        load_model(str(tmp_path))
