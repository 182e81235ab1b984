"""``paratron plan``: what fits and how fast. A memory model (model state from the parameters each rank
holds, activations by Korthikanti et al.'s accounting for paratron's layers, communication buffers,
allocator slack) and a time model (matmul FLOPs at a stated efficiency, communication volume per
collective over the interconnect, the pipeline bubble), a search over layouts, and the start-up lines
every training run prints. Pure functions of the config: it imports nothing but ``config`` and ``errors``."""
