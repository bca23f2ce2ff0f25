"""The engine core: one request's path from prompt to text.

``args`` (options -> config), ``input_processor`` (validate, tokenize, fan ``n`` out), ``request`` (one
sequence and its state), ``scheduler`` (which tokens run next, block tables, token stop rules), ``runner`` and
``sampler`` (one forward pass, next tokens), ``output_processor`` and ``detokenizer`` (text, stop strings,
logprob dicts, ``RequestOutput``), ``engine`` (composes them: ``step`` = schedule -> run -> update).
"""
