"""Megatron Core's ``models``: the GPT family (``models.gpt``) and BERT (``models.bert``)."""
