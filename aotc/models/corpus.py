"""Fixed text: what the tiny tokenizer is trained on, and the long smoke prompt."""

# The tokenizer is trained on this text, so that it is fixed and needs no download.
CORPUS = """
Ahead-of-time compilation traces each layer once per bucket with static shapes,
so one compiled graph serves every identical layer of the model. The weights and
the caches are inputs of the graph; the cache is written in place, directly.
A thin runtime loads the bundle, picks the smallest bucket that fits, pads the
batch, and runs. Engineers who deploy language models on accelerators lose hours
to recompiles, graph breaks, aliasing errors and cold starts. The quick brown fox
jumps over the lazy dog; pack my box with five dozen liquor jugs. Once upon a time
there was a small model that learned to count: one, two, three, four, five, six,
seven, eight, nine, ten. Hello, world! What is the capital of France? Paris.
"""
