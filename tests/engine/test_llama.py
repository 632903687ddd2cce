"""The engine's own Llama forward against transformers' LlamaForCausalLM (the reference)."""

import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from ddserve.engine.llama import Llama
from ddserve.engine.tree import build_tree, tree_mask
from ddserve.engine.weights import config_from_hf, from_hf_state_dict, load_model, to_hf


def hf_tiny(seed=0, vocab=97):
    torch.manual_seed(seed)
    cfg = HFConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def run_all(model: Llama, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    return model(torch.tensor(ids), torch.arange(len(ids)), cache)


def test_logits_match_transformers():
    hf = hf_tiny()
    mine = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))
    ids = [1, 5, 17, 33, 2, 90, 4, 4, 4, 61]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(run_all(mine, ids), ref, atol=1e-4)


def test_incremental_decoding_matches_full_forward():
    hf = hf_tiny(1)
    m = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))
    ids = [1, 8, 9, 10, 11, 12, 13]
    full = run_all(m, ids)
    cache = m.new_cache(capacity=2)  # forces growth
    m(torch.tensor(ids[:3]), torch.arange(3), cache)
    cache.commit(3)
    for i in range(3, len(ids)):
        step = m(torch.tensor([ids[i]]), torch.tensor([i]), cache)
        cache.commit(1)
        assert torch.allclose(step[0], full[i], atol=1e-4)


def test_tree_forward_equals_each_branch_alone_and_commit_compacts():
    hf = hf_tiny(2)
    m = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))
    prefix = [1, 40, 41, 42]
    lps = torch.log_softmax(torch.randn(3, 97, generator=torch.Generator().manual_seed(0)) * 3, -1)
    tree = build_tree(prefix[-1], lps, budget=7, topk=3)
    cache = m.new_cache()
    m(torch.tensor(prefix[:-1]), torch.arange(3), cache)
    cache.commit(3)
    pos = 3 + torch.tensor(tree.depths)
    logits = m(torch.tensor(tree.tokens), pos, cache, tree_mask(tree))
    for node in range(tree.size):
        path, n = [], node
        while n >= 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        alone = run_all(m, prefix[:-1] + path[::-1])
        assert torch.allclose(logits[node], alone[-1], atol=1e-4)
    # keep root + the deepest branch; the cache must then equal a plain prefill of that path
    leaf = max(range(tree.size), key=lambda i: tree.depths[i])
    branch, n = [], leaf
    while n > 0:
        branch.append(n)
        n = tree.parents[n]
    cache.commit([0, *branch[::-1]])
    ref = m.new_cache()
    seq = prefix + [tree.tokens[i] for i in branch[::-1]]
    m(torch.tensor(seq), torch.arange(len(seq)), ref)
    ref.commit(len(seq))
    assert cache.length == ref.length
    assert torch.allclose(cache.k[:, :, : cache.length], ref.k[:, :, : ref.length], atol=1e-5)


@pytest.mark.slow
def test_smollm2_matches_transformers_forward():
    """The bundled model through our forward vs transformers' with the same weights."""
    lm = load_model("smollm2-135m")
    hf = to_hf(lm.model)
    ids = lm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    mine = run_all(lm.model, ids)
    assert torch.allclose(mine, ref, atol=2e-3)
    assert lm.tokenizer.decode(mine[-1].argmax()) == " Rome"


def test_a_bad_model_path_never_tells_whether_it_exists(tmp_path):
    """A remote operator's reconfig sees the load error: it is the same for a missing path, an
    unreadable file and a directory that is no model."""
    import pytest

    from ddserve.engine.weights import load_model
    from ddserve.errors import ConfigError

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    (tmp_path / "dir").mkdir()
    messages = set()
    for spec in (
        str(tmp_path / "missing.gguf"),
        str(tmp_path / "junk.gguf"),
        str(tmp_path / "dir"),
        "/etc/passwd",
    ):
        with pytest.raises(ConfigError) as e:
            load_model(spec, with_tokenizer=False)
        messages.add(e.value.message.replace(repr(spec), "SPEC"))
    assert len(messages) == 1, messages
