"""Prefix caching through the server: a repeated prompt resumes from the cache (the metrics say
so) and gives the same greedy text as the first, cold request."""

from conftest import MODEL_NAME


def test_repeat_prompt_hits_and_matches(server, client):
    prompt = " ".join(f"word{i}" for i in range(120))  # several pages of 16 tokens
    before = server.metrics()
    cold = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                     temperature=0)
    warm = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                     temperature=0)
    after = server.metrics()
    assert warm.choices[0].text == cold.choices[0].text
    hits = after["deltaserve:prefix_cache_hits_total"] - before.get(
        "deltaserve:prefix_cache_hits_total", 0)
    assert hits >= 16, f"expected a prefix hit of at least one page, got {hits} tokens"
    assert after["deltaserve:prefix_cache_forks_total"] > before.get(
        "deltaserve:prefix_cache_forks_total", 0)
