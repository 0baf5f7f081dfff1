"""LLM support: models, checkpoint loaders, tokenizers, sampler, runner."""
