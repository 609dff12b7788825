"""Bridges from other libraries to fastmamba's ops.

``fastmamba.integrations.transformers``: ``use(model)`` / ``unuse(model)`` run transformers'
Mamba2ForCausalLM and NemotronHForCausalLM on fastmamba's kernels (see README.md here).
Importing this package imports nothing from transformers.
"""
