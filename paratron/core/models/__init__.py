"""Megatron Core's ``models``: the GPT family (``models.gpt``)."""
