"""Framework integrations. Each submodule imports its framework lazily, on import:

    import cp_softcap.integrations.hf   # registers attn_implementation="cp_softcap" with transformers
"""
