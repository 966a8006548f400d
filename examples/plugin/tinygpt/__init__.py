"""An example aotc plugin: a small GPT-style model in its own package.

aotc init tiny models/gpt --plugin tinygpt.model --arch tinygpt
aotc build models/gpt --plugin tinygpt.model
aotc run artifacts/gpt --check          # the bundle remembers its plugin
"""
